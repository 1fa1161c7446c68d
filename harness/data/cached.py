"""Rows from the token cache of a local dataset (text, jsonl, parquet), text and chat: global rows dealt to
data-parallel ranks, exactly resumable at any data-parallel degree.

The cache (harness/data/token_cache.py: key, layout, atomic build) is built once, by all ranks together: each file is
cut into work units (byte ranges of UNIT_BYTES at document boundaries, parquet row groups) that depend on the files
only, and rank r of W tokenizes units r, r + W, ... So no rank parses documents it does not tokenize.

Rows are global, fixed by the cache, whatever the number of ranks: global micro-batch m holds rows [m*W*b, (m+1)*W*b)
(W data-parallel ranks, b = batch_size rows each) and DP rank r takes rows m*W*b + r + j*W, j = 0..b-1. One process
with b = 4 and two with b = 2 train on the same rows in each micro-batch. After the last full row an infinite loader
wraps to row 0 (a new epoch); a finite one stops before a global micro-batch it cannot fill, on every rank alike.
Text rows are windows of the token stream (harness/data/rows.py); chat rows whole conversations in padded rows, laid
out by harness/data/chat_packing.py from the cache's target flags.

Resume: `state_dict()` is the number of global rows consumed plus seq_len and the ids of the tokenizer and of the
token stream (plain ints and strings, the same on every DP rank; for chat, also the packing). `load_state_dict`
continues exactly, also at another data-parallel degree or batch size, and also from a copy of the dataset at another
path; a state that does not fit is a DataError naming the difference (harness/data/saved_position.py).
Every row read is checked against the tokenizer's vocabulary and the document starts against the row (cheap, and a
guard behind the cache's own checks): no id outside the embedding reaches the model.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import numpy as np
import torch

from . import token_cache
from .chat import ChatOptions, chat_identity
from .chat_packing import cache_layout, layout_summary, pad_id_of
from .encoders import ChatEncoder
from .errors import DataError
from .ranks import on_every_rank, rank_and_world
from .rows import chat_row, check_loader_args, packed_row, stack_rows
from .saved_position import CACHED, check_saved_position
from .sources import SOURCE_SUFFIXES, read_unit, source_files, source_units
from .token_cache import TokenCache, Verify

logger = logging.getLogger(__name__)

UNIT_BYTES = 64 << 20  # work unit of the cache build: enough units to spread over ranks, each worth a seek


def _source_identity(kind: str, files: list[Path], text_field: str, chat: dict | None = None) -> dict:
    """What the cache key hashes: any change of file, size or mtime gives a new cache; for chat data also the chat
    keys and the chat template's text (`chat`, harness/data/chat.py's chat_identity)."""
    stats = [(f.resolve(), f.stat()) for f in files]
    identity = {"kind": kind, "text_field": None if kind == "text" or chat else text_field,
                "files": [{"path": str(p), "bytes": s.st_size, "mtime_ns": s.st_mtime_ns} for p, s in stats]}
    return {**identity, **chat} if chat else identity


def load_token_cache(kind: str, path: str, text_field: str, tokenizer, cache_dir: str | Path,
                     verify: Verify = "quick", chat: ChatOptions | None = None,
                     encoder: ChatEncoder | None = None) -> TokenCache:
    """The token cache of a local source, built first if absent, then checked (collective: see
    harness/data/token_cache.py). Chat data: `chat` and its `encoder`; `text_field` is then the messages field."""
    chat_id = chat_identity(tokenizer.path, chat) if chat else None

    def list_units():
        files = source_files(Path(path), SOURCE_SUFFIXES[kind])
        return _source_identity(kind, files, text_field, chat_id), source_units(kind, files, UNIT_BYTES)

    # A rank that cannot list the files (a path missing on one node) fails every rank instead of hanging them.
    source, units = on_every_rank(list_units, f"listing the {kind} files of {path}")
    read = functools.partial(read_unit, kind, text_field=text_field)
    if chat:
        read = functools.partial(read, rows=True, max_row_bytes=chat.max_row_bytes)
    return token_cache.load_or_build(cache_dir, source, units, read, tokenizer, verify, encoder)


class TokenCacheLoader:
    """The global rows of a token cache, dealt to data-parallel ranks; exactly resumable at any DP degree.
    Subclasses lay the rows out otherwise (`_count_rows`, `_row`): harness/data/chat_packing.py."""

    packing = "text"  # how rows are cut from the cache: a saved position resumes only rows packed the same way

    def __init__(self, cache: TokenCache, seq_len: int, batch_size: int, dp_rank: int = 0, dp_world_size: int = 1,
                 infinite: bool = True):
        check_loader_args(seq_len, batch_size, dp_rank, dp_world_size)
        self.cache, self.seq_len, self.batch_size = cache, seq_len, batch_size
        self.dp_rank, self.dp_world_size, self.infinite = dp_rank, dp_world_size, infinite
        # Every rank lays out the same rows: a layout that cannot train fails on all, and rank 0 names it.
        self.num_rows = on_every_rank(self._count_rows, f"laying out the rows of {cache.folder}")
        self.next_row = 0  # global rows consumed by all DP ranks together: the whole resumable state
        self._epoch_logged = 0

    def _count_rows(self) -> int:
        num_rows = max(len(self.cache.tokens) - 1, 0) // self.seq_len  # row k needs tokens up to k*L + L
        if num_rows == 0:
            raise DataError(f"dataset cache {self.cache.folder} holds {len(self.cache.tokens)} tokens, too few for "
                            f"one row of seq_len {self.seq_len} (needs {self.seq_len + 1}); use more data or a "
                            f"shorter seq_len")
        return num_rows

    @property
    def epoch(self) -> int:
        return self.next_row // self.num_rows

    def __iter__(self) -> TokenCacheLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        W, first = self.dp_world_size, self.next_row
        end = first + W * self.batch_size  # this global micro-batch: rows [first, end) of all ranks
        if not self.infinite and end > self.num_rows:
            raise StopIteration
        rows = [self._row((first + self.dp_rank + j * W) % self.num_rows) for j in range(self.batch_size)]
        self.next_row = end
        self._log_new_epoch((end - 1) // self.num_rows)
        return stack_rows(rows)

    def _row(self, k: int) -> dict[str, torch.Tensor]:
        L, lo = self.seq_len, k * self.seq_len
        window = self.cache.tokens[lo: lo + L + 1].astype(np.int64)
        first, last = np.searchsorted(self.cache.doc_starts, [lo, lo + L + 1])
        offsets = self.cache.doc_starts[first:last] - lo
        # The cache was checked when opened, its tokens by sample unless verified in full: a row outside the
        # sample, or a file changed since, is caught here, before an id indexes past the embedding.
        if window.max() >= self.cache.vocab_size:
            raise self._damaged(k, f"holds token id {int(window.max())}, outside the tokenizer's vocabulary of "
                                   f"{self.cache.vocab_size}")
        if offsets.size and not 0 <= offsets.min() <= offsets.max() <= L:
            raise self._damaged(k, f"has document starts {offsets.min() + lo}..{offsets.max() + lo} outside it")
        starts = torch.zeros(L + 1, dtype=torch.bool)
        starts[torch.from_numpy(offsets)] = True
        return packed_row(torch.from_numpy(window), starts)

    def _damaged(self, k: int, what: str) -> DataError:
        lo = k * self.seq_len
        return DataError(f"dataset cache {self.cache.folder} is damaged: row {k} (tokens {lo}..{lo + self.seq_len}) "
                         f"{what}. Delete the folder (rm -r {self.cache.folder}) and the next run rebuilds it from "
                         f"the dataset")

    def _log_new_epoch(self, epoch: int) -> None:
        if epoch > self._epoch_logged:
            self._epoch_logged = epoch
            if self.dp_rank == 0 and epoch & (epoch - 1) == 0:  # epochs 1, 2, 4, 8, ...: a tiny set stays quiet
                logger.info(f"data: read all {self.num_rows} rows of dataset cache {self.cache.folder}; epoch "
                            f"{epoch} starts again at row 0")

    def state_dict(self) -> dict:
        """Plain ints and strings, the same on every DP rank."""
        return {"next_row": self.next_row, "seq_len": self.seq_len, "tokenizer_id": self.cache.tokenizer_id,
                "stream_id": self.cache.stream_id}

    def load_state_dict(self, sd: dict) -> None:
        sd = check_saved_position(sd, CACHED, {"next_row": int}, {
            "packing": self.packing, "seq_len": self.seq_len, "tokenizer_id": self.cache.tokenizer_id,
            "stream_id": self.cache.stream_id}, source=str(self.cache.folder))
        if sd["next_row"] < 0:
            raise DataError(f"the saved data position (next_row {sd['next_row']}) is negative")
        self.next_row = sd["next_row"]
        self._epoch_logged = max(self.next_row - 1, 0) // self.num_rows


class ChatCacheLoader(TokenCacheLoader):
    """The global chat rows of a token cache with targets, laid out by harness/data/chat_packing.py (whole
    conversations, padded rows), dealt and resumed as TokenCacheLoader's rows (`next_row`)."""

    def __init__(self, cache: TokenCache, seq_len: int, batch_size: int, dp_rank: int = 0, dp_world_size: int = 1,
                 infinite: bool = True, overlong: str = "drop", pad_id: int = 0):
        if cache.targets is None:
            raise ValueError(f"dataset cache {cache.folder} has no targets.bin: it is not a cache of chat data")
        self.overlong, self.pad_id = overlong, pad_id
        self.packing = f"chat, chat_overlong {overlong}"
        super().__init__(cache, seq_len, batch_size, dp_rank, dp_world_size, infinite)

    def _count_rows(self) -> int:
        self.layout = cache_layout(self.cache, self.seq_len + 1, self.overlong)
        if rank_and_world()[0] == 0:  # once per run, not once per rank
            logger.info(f"data: chat rows of {token_cache.source_files(self.cache.meta['source'])}: "
                        + layout_summary(self.layout, self.cache, self.seq_len + 1, self.overlong))
        return self.layout.num_rows

    def _row(self, k: int) -> dict[str, torch.Tensor]:
        layout, cache = self.layout, self.cache
        first, stop = int(layout.row_first[k]), int(layout.row_first[k + 1])
        pieces = []
        for doc, n in zip(layout.docs[first:stop].tolist(), layout.taken[first:stop].tolist()):
            lo = int(cache.doc_starts[doc])
            pieces.append((cache.tokens[lo: lo + n].astype(np.int64), cache.targets[lo: lo + n]))
        # As for text rows: the cache was checked by sample, so each row read is checked too.
        high = max(int(ids.max()) for ids, _ in pieces)
        if high >= cache.vocab_size:
            raise self._damaged(k, f"holds token id {high}, outside the tokenizer's vocabulary of {cache.vocab_size}")
        if max(int(flags.max()) for _, flags in pieces) > 1:
            raise self._damaged(k, "holds target flags other than 0 and 1")
        return chat_row(pieces, self.seq_len + 1, self.pad_id)

    def _damaged(self, k: int, what: str) -> DataError:
        return DataError(f"dataset cache {self.cache.folder} is damaged: chat row {k} {what}. Delete the folder "
                         f"(rm -r {self.cache.folder}) and the next run rebuilds it from the dataset")

    def state_dict(self) -> dict:
        return {**super().state_dict(), "packing": self.packing}


def cached_rows(kind: str, path: str, text_field: str, tokenizer, cache_dir: str | Path, verify: Verify, seq_len: int,
                batch_size: int, dp_rank: int, dp_world_size: int, infinite: bool, chat: ChatOptions | None = None,
                encoder: ChatEncoder | None = None) -> TokenCacheLoader:
    """The rows of the token cache of a local dataset (built first if absent; collective): text rows, or with `chat`
    (its row limit resolved) and its `encoder`, chat rows."""
    if chat is None:
        cache = load_token_cache(kind, path, text_field, tokenizer, cache_dir, verify)
        return TokenCacheLoader(cache, seq_len, batch_size, dp_rank, dp_world_size, infinite)
    cache = load_token_cache(kind, path, chat.messages_field, tokenizer, cache_dir, verify, chat, encoder)
    return ChatCacheLoader(cache, seq_len, batch_size, dp_rank, dp_world_size, infinite, chat.overlong,
                           pad_id_of(tokenizer))
