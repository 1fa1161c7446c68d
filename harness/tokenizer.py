"""Tokenizers: a built-in byte-level one for the embedded default, and local Hugging Face folders.

Both expose `vocab_size`, `bos_id`, `eos_id` (int or None), `encode(text) -> list[int]` (no special tokens)
and `decode(ids) -> str`.
"""

from __future__ import annotations

import json
from pathlib import Path


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255, then BOS=256 and EOS=257: needs no files, so the debug run is self-contained."""

    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        # A window may cut a multi-byte character in half; "replace" keeps decoding total.
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face tokenizer: a folder with tokenizer.json (+ optional tokenizer_config.json) or the
    tokenizer.json file itself. Loaded with the `tokenizers` library so no hub access can happen."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(
                f"tokenizer not found: {file} (model.tokenizer_path must be a local folder holding tokenizer.json "
                f"or the tokenizer.json file itself; leave it empty for the built-in byte tokenizer)"
            )
        self.path = str(file)
        self._tok = Tokenizer.from_file(str(file))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config = _read_tokenizer_config(file.parent / "tokenizer_config.json")
        self.bos_id = self._special_id(config.get("bos_token"))
        self.eos_id = self._special_id(config.get("eos_token"))

    def _special_id(self, token) -> int | None:
        if isinstance(token, dict):  # older configs store AddedToken dicts
            token = token.get("content")
        if not token:
            return None
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"tokenizer_config.json names special token {token!r}, absent from {self.path}")
        return tid

    def encode(self, text: str) -> list[int]:
        # Specials are added by the packer, one BOS/EOS per document, not per encode call.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _read_tokenizer_config(file: Path) -> dict:
    if not file.is_file():
        return {}
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def build_tokenizer(tokenizer_path: str) -> ByteTokenizer | HFTokenizer:
    """"" selects the built-in byte tokenizer; anything else is a local Hugging Face tokenizer path."""
    return HFTokenizer(tokenizer_path) if tokenizer_path else ByteTokenizer()
