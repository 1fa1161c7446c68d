"""Tokenizers: a built-in byte-level one for the embedded default, and local Hugging Face folders.

Both expose `vocab_size`, `bos_id`, `eos_id` (int or None), `encode(text) -> list[int]` (no special tokens),
`decode(ids) -> str` and `save_pretrained(folder)`, which writes the tokenizer files into a Hugging Face export
for `transformers.AutoTokenizer.from_pretrained(folder)` (each method says what ids that gives).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# The files of a Hugging Face tokenizer folder besides tokenizer.json that an export carries over; weights,
# config.json and custom Python code are not among them.
TOKENIZER_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)
CHAT_TEMPLATES_FOLDER = "additional_chat_templates"
BYTE_BOS, BYTE_EOS = "<|bos|>", "<|eos|>"  # the names of ByteTokenizer's ids 256 and 257 in its export


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

    def save_pretrained(self, folder: str | Path) -> None:
        """Write tokenizer.json + tokenizer_config.json: this tokenizer for `transformers`.

        tokenizer.json: the ByteLevel pre-tokenizer (no regex split, no prefix space) shows each UTF-8 byte of
        the text as one printable character, and a BPE model without merges maps that character to the byte's
        value; BOS and EOS are added tokens at 256 and 257. Encoding with specials (transformers' default)
        prepends BOS, as every training document began with it. `split_special_tokens` keeps text that spells
        "<|bos|>" as bytes, as `encode` does.

        transformers loads the tokenizer of a qwen3_5_moe_text checkpoint as its Qwen3_5Tokenizer, whatever
        tokenizer_config.json names. That class takes the vocab, merges, added tokens and post-processor from
        tokenizer.json but adds its own NFC normalizer (and a regex split, which changes nothing without merges):
        `AutoTokenizer` encodes `unicodedata.normalize("NFC", text)`, the same as `encode(text)` for NFC text;
        `PreTrainedTokenizerFast.from_pretrained(folder)` runs tokenizer.json as written, `encode(text)` for any text.
        """
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

        vocab = {char: byte for byte, char in enumerate(_byte_level_chars())}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(BYTE_BOS, special=True), AddedToken(BYTE_EOS, special=True)])  # 256, 257
        tok.post_processor = processors.TemplateProcessing(single=f"{BYTE_BOS} $A",
                                                           special_tokens=[(BYTE_BOS, self.bos_id)])
        folder = Path(folder)
        tok.save(str(folder / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BYTE_BOS, "eos_token": BYTE_EOS,
                  "pad_token": None, "unk_token": None, "split_special_tokens": True,
                  "clean_up_tokenization_spaces": False}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _byte_level_chars() -> list[str]:
    """The character that the ByteLevel pre-tokenizer (GPT-2's byte-level alphabet) shows for byte 0..255:
    printable Latin-1 bytes stand for themselves, the other 68 take U+0100, U+0101, ... in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    chars, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


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

    def save_pretrained(self, folder: str | Path) -> None:
        """Copy the tokenizer files this tokenizer was loaded from (tokenizer.json, its tokenizer_config.json,
        vocab, merges, chat templates, ...) into `folder`.

        transformers loads the tokenizer of a qwen3_5_moe_text checkpoint as its Qwen3_5Tokenizer, whatever
        tokenizer_config.json names: the Qwen3.5 pipeline (NFC, its split regex, byte-level BPE) around the
        vocab, merges, added tokens and post-processor of tokenizer.json. For a Qwen-style byte-level BPE (the
        Qwen3.5 tokenizer itself) `AutoTokenizer` gives our ids; for another kind of tokenizer load the export
        with `PreTrainedTokenizerFast.from_pretrained(folder)`, which runs tokenizer.json as written.
        """
        source, folder = Path(self.path), Path(folder)
        shutil.copyfile(source, folder / "tokenizer.json")  # under its standard name even if the source differs
        for name in TOKENIZER_FILES:
            if (source.parent / name).is_file():
                shutil.copyfile(source.parent / name, folder / name)
        if (source.parent / CHAT_TEMPLATES_FOLDER).is_dir():
            shutil.copytree(source.parent / CHAT_TEMPLATES_FOLDER, folder / CHAT_TEMPLATES_FOLDER)


def _read_tokenizer_config(file: Path) -> dict:
    if not file.is_file():
        return {}
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def build_tokenizer(tokenizer_path: str) -> ByteTokenizer | HFTokenizer:
    """"" selects the built-in byte tokenizer; anything else is a local Hugging Face tokenizer path."""
    return HFTokenizer(tokenizer_path) if tokenizer_path else ByteTokenizer()
