"""Encoders: a document, or a chat row, to its token ids (and target flags), for the token cache's build
(harness/data/token_cache.py) and for streams (harness/data/streamed.py). Each has `with_targets`, `__call__` (ids and
flags, or Skipped for a row it cannot use), `start_unit` (before each work unit) and `finish` (what it found along
the way, raised once a rank has encoded all its units)."""

from __future__ import annotations

import numpy as np

from .chat import (
    ASSISTANT_HEADER,
    CHECK_EVERY,
    TURN_END,
    ChatOptions,
    assistant_spans,
    chat_template_problem,
    conversation_problem,
    has_content,
    target_mask,
    template_messages,
    tokenizer_folder,
)
from .errors import DataError
from .long_text import encode_text
from .sources import Row, Skipped, lone_surrogate_problem


class TextEncoder:
    """Text documents: [bos] + tokens + [eos], each special only when the tokenizer has one; no targets (every
    token is one). A long document is tokenized in pieces (harness/data/long_text.py) and its ids come as an int64
    array, a short one's as a list. ChatEncoder (below) is the other kind: rows to ids and target flags."""

    with_targets = False

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
        self.eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []

    def __call__(self, text: str) -> tuple[list[int] | np.ndarray, None]:
        ids = encode_text(self.tokenizer, text)
        if isinstance(ids, np.ndarray):
            return np.concatenate([np.asarray(self.bos, dtype=np.int64), ids,
                                   np.asarray(self.eos, dtype=np.int64)]), None
        return self.bos + ids + self.eos, None

    def start_unit(self) -> None:
        """Called before each work unit is read."""

    def finish(self) -> None:
        """Called once a rank has encoded all its units: raise what was found along the way (nothing, here)."""


class ChatEncoder:
    """Chat rows to (token ids, target flags), as harness/data/chat.py describes. `__call__` gives Skipped for a row it
    cannot use; `finish()` raises the rows whose ids differ from apply_chat_template's, all in one DataError."""

    with_targets = True

    def __init__(self, tokenizer, options: ChatOptions, check_every: int | None = None):
        self.path = getattr(tokenizer, "path", None) or ""
        problem = chat_template_problem(self.path)
        if problem:
            raise DataError(problem)
        self.folder = tokenizer_folder(self.path)
        self.options, self.check_every = options, check_every or CHECK_EVERY
        self._tok = None
        self.encoded = 0  # conversations encoded: picks the ones checked
        self.mismatches: list[str] = []

    @property
    def tok(self):
        if self._tok is None:  # transformers loads in seconds: only when a cache is built or a stream is read
            from transformers import PreTrainedTokenizerFast

            self._tok = PreTrainedTokenizerFast.from_pretrained(str(self.folder), local_files_only=True)
        return self._tok

    def start_unit(self) -> None:
        """A new work unit: its first conversation is checked."""
        self.encoded = 0

    def __call__(self, row: Row) -> tuple[list[int], list[int]] | Skipped:
        value = row.value
        problem = conversation_problem(value, self.options.messages_field)
        if problem:
            return Skipped(row.locate, problem)
        messages, tools = template_messages(value[self.options.messages_field]), value.get("tools")
        try:
            text = self.tok.apply_chat_template(messages, tools=tools, tokenize=False)
        except Exception as e:  # the template's raise_exception, a jinja error, a value it cannot print
            message = (str(e).strip().splitlines() or [type(e).__name__])[0]
            return Skipped(row.locate, f"the chat template refused it ({message})")
        problem = lone_surrogate_problem(text)  # from any field the template rendered: tokenizers refuse it
        if problem:
            return Skipped(row.locate, problem)
        encoding = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoding["input_ids"])
        if self.options.targets == "all":
            targets = [1] * len(ids)
        else:
            spans = assistant_spans(text)
            wanted = sum(m["role"] == "assistant" for m in messages)
            if not spans:
                raise DataError(f"the chat template of {self.folder} is not Qwen-style (ChatML): its rendering of "
                                f"{row.locate()} holds no {ASSISTANT_HEADER!r} header, so the assistant turns (the "
                                f"targets) cannot be found; use such a template, or training.chat_targets = 'all'")
            if len(spans) != wanted:
                return Skipped(row.locate, f"the template rendered {len(spans)} assistant turns for {wanted} "
                                           f"assistant messages")
            if problem := self._empty_turn(messages, text, spans):
                return Skipped(row.locate, problem)
            targets = target_mask(encoding["offset_mapping"], spans)
            if not any(targets):  # nothing to learn (harness/data/chat_packing.py relies on every one holding one)
                return Skipped(row.locate, "the template rendered its assistant turns without a token")
        if self.encoded % self.check_every == 0:
            self._check(row, messages, tools, ids)
        self.encoded += 1
        return ids, targets

    def _empty_turn(self, messages: list[dict], text: str, spans: list[tuple[int, int]]) -> str | None:
        """An assistant message with content whose turn the template rendered empty (a template that renders
        some fields only): its reply would train as an empty answer."""
        assistant = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
        for i, (start, stop) in zip(assistant, spans):
            if has_content(messages[i]) and not text[start:stop].removesuffix(TURN_END).strip():
                return (f"the chat template rendered {self.options.messages_field}[{i}] (assistant) empty, though it "
                        f"has content: the template does not render it")
        return None

    def _check(self, row: Row, messages, tools, ids: list[int]) -> None:
        reference = self.tok.apply_chat_template(messages, tools=tools, tokenize=True)
        if hasattr(reference, "keys"):  # a BatchEncoding (transformers 5), or a list of ids
            reference = reference["input_ids"]
        reference = list(reference)
        if reference != ids:
            first = next((i for i, (a, b) in enumerate(zip(ids, reference)) if a != b), min(len(ids), len(reference)))
            self.mismatches.append(f"{row.locate()} at token {first} ({len(ids)} tokens here, {len(reference)} "
                                   f"there)")

    def finish(self) -> None:
        if self.mismatches:
            shown = "; ".join(self.mismatches[:5]) + (f"; and {len(self.mismatches) - 5} more"
                                                      if len(self.mismatches) > 5 else "")
            raise DataError(f"the token ids of {len(self.mismatches)} conversations differ from transformers' "
                            f"apply_chat_template(..., tokenize=True) with the tokenizer {self.folder}: {shown}. "
                            f"Its tokenizer_config.json settings make transformers tokenize otherwise than the "
                            f"harness; report it with that folder")
