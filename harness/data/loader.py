"""Training data: packed rows with document boundaries from a tokenized cache (or a stream), DP dealing, resume.

Documents come from harness/data/sources.py (local text / jsonl / parquet files, or a Hugging Face stream).

The trainer calls `build_dataloader`, on every rank of the world when torch.distributed is initialized. Its
batches are dicts of (batch_size, seq_len) int64 tensors: input_ids, labels, position_ids.

Packing, the contract the model relies on (docs/design.md, "Packed documents"):
  - each document becomes [bos if the tokenizer has one] + tokens + [eos if it has one]; the documents are
    concatenated into one token stream;
  - row k is the window stream[k*L : k*L + L + 1] (L = seq_len): input_ids = window[:-1], labels = window[1:].
    Windows overlap by one token, so every token is an input once and every next-token pair is a label once;
  - labels are -100 where the next token starts another document: never predict across a boundary;
  - position_ids restart at 0 at every document start and at every row start. A document cut by a row end
    continues in the next row with positions from 0 again: the model treats each row start as a document
    start (GDN state, conv history and attention reset there), the usual cost of packing without padding.

Local sources (text, jsonl, parquet) are tokenized once into a memory-mapped cache under `cache_dir`
(harness/data/token_cache.py: key, layout, atomic build). The build is shared: each file is cut into work units
(byte ranges of UNIT_BYTES at document boundaries, parquet row groups) that depend on the files only, and
rank r of W tokenizes units r, r + W, ... So no rank parses documents it does not tokenize.
Rows are then global, fixed by the cache, whatever the number of ranks: global micro-batch m holds rows
[m*W*b, (m+1)*W*b) (W data-parallel ranks, b = batch_size rows each) and DP rank r takes rows m*W*b + r + j*W,
j = 0..b-1. One process with b = 4 and two with b = 2 train on the same rows in each micro-batch. After the
last full row an infinite loader wraps to row 0 (a new epoch); a finite one stops before a global micro-batch
it cannot fill, on every rank alike.
Resume: `state_dict()` is the number of global rows consumed plus seq_len and the ids of the tokenizer and of
the token stream (plain ints and strings, the same on every DP rank). `load_state_dict` continues exactly,
also at another data-parallel degree or batch size, and also from a copy of the dataset at another path; a
state from another tokenizer, token stream or seq_len, or one that is not a state of this kind of loader, is a
DataError naming the difference (bad input: exit 2), never a crash or a silent restart at another position.
Every row read is checked against the tokenizer's vocabulary and the document starts against the row (cheap, and
a guard behind the cache's own checks, harness/data/token_cache.py): no id outside the embedding reaches the model.

Hugging Face streams (hf) have no cache: each DP rank reads its shard (datasets.distributed.
split_dataset_by_node) and packs it on its own, as far as the prefetch queue allows ahead of the training step,
in a background thread. Their rows therefore DO depend on the number of data-parallel ranks, and their state
resumes only at the same DP rank and degree, by skipping (reading without tokenizing) the consumed documents.

Context-parallel ranks of one DP rank pass the same dp_rank and get the same rows; they split them later.

Chat data (data_format "chat", harness/data/chat.py) goes through the same cache, with a target flag per token beside
the tokens, and is packed otherwise: whole conversations in padded rows (harness/data/chat_packing.py).
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import weakref
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple

import numpy as np
import torch

from . import token_cache
from .chat import ChatEncoder, ChatOptions, chat_identity
from .chat_packing import cache_layout, chat_window, layout_summary, pad_id_of
from .errors import DataError
from .sources import (SOURCE_SUFFIXES, Row, Skipped, check_source, hf_documents, read_unit, source_files,
                      source_units)
from .token_cache import TextEncoder, TokenCache, Verify

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index


def _report_left_out(count: int, dp_rank: int, what: str, latest: str, done: str = "left out") -> None:
    """A stream's rows left out so far, logged at the 1st, 10th, 100th and every 1000th: a stream has no end to
    report them at, and a line per row would flood the log."""
    if count in (1, 10, 100) or count % 1000 == 0:
        logger.warning(f"data: dp rank {dp_rank} {done} {count} {what} so far (the latest: {latest})")
UNIT_BYTES = 64 << 20  # work unit of the cache build: enough units to spread over ranks, each worth a seek
PREFETCH_BATCHES = 4  # hf: batches packed ahead of the training step
_END = object()  # end of a pass over the documents


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
    source, units = token_cache.on_every_rank(list_units, f"listing the {kind} files of {path}")
    read = functools.partial(read_unit, kind, text_field=text_field)
    if chat:
        read = functools.partial(read, rows=True, max_row_bytes=chat.max_row_bytes)
    return token_cache.load_or_build(cache_dir, source, units, read, tokenizer, verify, encoder)


# ---------------------------------------------------------------------------------------------------------------
# Packing


def packed_row(window: torch.Tensor, starts: torch.Tensor) -> dict[str, torch.Tensor]:
    """One row from a window of L + 1 stream tokens (int64) and its flags (bool): does a document start here?"""
    L = window.numel() - 1
    labels = window[1:].clone()
    labels[starts[1:]] = IGNORE_INDEX  # the next token opens another document
    row_starts = starts[:-1].clone()
    row_starts[0] = True  # every row start is a document start for the model
    idx = torch.arange(L)
    last_start = torch.where(row_starts, idx, 0).cummax(0).values
    return {"input_ids": window[:-1], "labels": labels, "position_ids": idx - last_start}


def _stack(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def _check_shape_args(seq_len: int, batch_size: int, dp_rank: int, dp_world_size: int) -> None:
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be positive")
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_world_size={dp_world_size})")


class TokenCacheLoader:
    """The global rows of a token cache, dealt to data-parallel ranks; exactly resumable at any DP degree.
    Subclasses lay the rows out otherwise (`_count_rows`, `_row`): harness/data/chat_packing.py."""

    packing = "text"  # how rows are cut from the cache: a saved position resumes only rows packed the same way

    def __init__(self, cache: TokenCache, seq_len: int, batch_size: int, dp_rank: int = 0, dp_world_size: int = 1,
                 infinite: bool = True):
        _check_shape_args(seq_len, batch_size, dp_rank, dp_world_size)
        self.cache, self.seq_len, self.batch_size = cache, seq_len, batch_size
        self.dp_rank, self.dp_world_size, self.infinite = dp_rank, dp_world_size, infinite
        # Every rank lays out the same rows: a layout that cannot train fails on all, and rank 0 names it.
        self.num_rows = token_cache.on_every_rank(self._count_rows, f"laying out the rows of {cache.folder}")
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
        return _stack(rows)

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
        if not isinstance(sd, dict) or "next_row" not in sd:
            raise DataError("the saved data loader state has no 'next_row': it was saved by a loader of a streamed "
                            "(hf) dataset or by an older version, and cannot resume the local dataset of this run")
        _check_state_keys(sd, {"next_row": int, "seq_len": int, "tokenizer_id": str, "stream_id": str})
        if sd.get("packing", "text") != self.packing:
            raise DataError(f"the saved data position is in rows packed as {sd.get('packing', 'text')!r}, this run "
                            f"packs them as {self.packing!r}: rows would not line up; resume with the same "
                            f"training.data_format and training.chat_overlong")
        if sd["seq_len"] != self.seq_len:
            raise DataError(f"the saved data position is in rows of seq_len {sd['seq_len']}, this run has seq_len "
                            f"{self.seq_len}: rows would not line up; resume with the same training.seq_len")
        if sd["tokenizer_id"] != self.cache.tokenizer_id:
            raise DataError(f"the saved data position is in tokens of another tokenizer (id {sd['tokenizer_id']}, "
                            f"this run {self.cache.tokenizer_id}, see {self.cache.folder}/meta.json); resume with "
                            f"the same model.tokenizer_path")
        if sd["stream_id"] != self.cache.stream_id:
            raise DataError(f"the saved data position is in another dataset (token stream {sd['stream_id']}, this "
                            f"run {self.cache.stream_id} from {self.cache.folder}): were files added or changed? "
                            f"Resume with the same dataset, or start in another job.dump_folder")
        if sd["next_row"] < 0:
            raise DataError(f"the saved data position (next_row {sd['next_row']}) is negative")
        self.next_row = sd["next_row"]
        self._epoch_logged = max(self.next_row - 1, 0) // self.num_rows


def _check_state_keys(sd: dict, types: dict[str, type]) -> None:
    for key, kind in types.items():
        if not isinstance(sd.get(key), kind) or isinstance(sd.get(key), bool):
            raise DataError(f"the saved data loader state has {key}={sd.get(key)!r} where a {kind.__name__} belongs: "
                            f"it was saved by another version or is damaged")


class _PassTally:
    """A stream's rows kept (with a target, for chat) and not in one pass over its documents: a whole pass (read
    from its first row) that kept none is an error, where reading on would only pass over the same rows again."""

    def __init__(self, whole: bool):
        self.whole, self.kept, self.first_left_out = whole, 0, None

    def left_out(self, where: str) -> None:
        self.first_left_out = self.first_left_out or where


def _skipped_where(skipped: Skipped) -> str:
    return f"{skipped.locate()}: {skipped.reason or 'a null text field'}"


class StreamPacker:
    """Packs the documents of one DP rank into rows as they come (hf streams); plain and exactly resumable.

    `documents` opens a fresh pass over this rank's documents each time it is called: once per epoch, and again
    after `load_state_dict`. With infinite=True an exhausted source starts a new epoch (the token stream carries
    on across the epoch boundary); otherwise `next_batch` raises StopIteration, dropping the last partial batch.
    A whole pass that keeps no document (every row null or damaged) is a DataError naming the first.
    """

    def __init__(self, documents: Callable[[], Iterable[str]], tokenizer, seq_len: int, batch_size: int,
                 dp_rank: int = 0, dp_world_size: int = 1, infinite: bool = True):
        _check_shape_args(seq_len, batch_size, dp_rank, dp_world_size)
        self.documents, self.tokenizer = documents, tokenizer
        self.encoder = TextEncoder(tokenizer) if tokenizer is not None else None  # chat: ChatStreamPacker's own
        self.seq_len, self.batch_size = seq_len, batch_size
        self.dp_rank, self.dp_world_size, self.infinite = dp_rank, dp_world_size, infinite
        self.epoch = 0
        self.doc_index = 0  # documents of this rank read in this epoch
        self._tokens: list[int] = []  # stream not yet emitted; _tokens[0] is the next row's first input
        self._starts: list[bool] = []  # per token of _tokens: does a document start there?
        self._docs: Iterator[str | Skipped] | None = None  # this rank's documents from doc_index on; None = reopen
        self.skipped = 0  # rows left out by this packer (null text, damaged); reported at 1, 10, 100, ...
        self._pass = _PassTally(whole=False)  # the rows kept and left out in the pass being read

    def next_batch(self) -> dict[str, torch.Tensor]:
        return _stack([self._next_row() for _ in range(self.batch_size)])  # StopIteration ends a finite packer

    def _next_row(self) -> dict[str, torch.Tensor]:
        L = self.seq_len
        while len(self._tokens) < L + 1:
            self._append_document(self._next_document())
        window = torch.tensor(self._tokens[: L + 1], dtype=torch.long)
        starts = torch.tensor(self._starts[: L + 1], dtype=torch.bool)
        del self._tokens[:L], self._starts[:L]  # keep the window's last token: it is the next row's first input
        return packed_row(window, starts)

    def _append_document(self, text: str | Skipped) -> None:
        if isinstance(text, Skipped):
            self.skipped += 1
            where = _skipped_where(text)
            self._pass.left_out(where)
            _report_left_out(self.skipped, self.dp_rank, "rows with a null text field, or damaged,", where)
            return
        ids, _ = self.encoder(text)
        ids = ids if isinstance(ids, list) else ids.tolist()  # a long document comes in an array
        if ids:  # an empty document without specials leaves no trace in the stream
            self._tokens += ids
            self._starts += [True] + [False] * (len(ids) - 1)
            self._pass.kept += 1

    def _next_document(self) -> str | Skipped:
        while True:
            if self._docs is None:  # skip without tokenising: resume costs one read of the skipped documents
                self._docs = itertools.islice(iter(self.documents()), self.doc_index, None)
                self._pass = _PassTally(whole=self.doc_index == 0)
            doc = next(self._docs, _END)
            if doc is not _END:
                self.doc_index += 1
                return doc
            if self.doc_index == 0:
                raise DataError(f"data-parallel rank {self.dp_rank} of {self.dp_world_size} got no documents: "
                                f"the dataset has fewer documents (or shards) than data-parallel ranks")
            if self._pass.whole and self._pass.kept == 0:  # another pass would find nothing either
                raise DataError(f"dp rank {self.dp_rank} of {self.dp_world_size} has nothing to train on: all "
                                f"{self.doc_index} rows of its shard of the dataset were left out or hold no target "
                                f"(the first: {self._pass.first_left_out})")
            if not self.infinite:
                raise StopIteration
            self.epoch, self.doc_index, self._docs = self.epoch + 1, 0, None
            if self.dp_rank == 0 and self.epoch & (self.epoch - 1) == 0:  # epochs 1, 2, 4, 8, ...
                logger.info(f"data: dp rank 0 finished its shard of the dataset, starting epoch {self.epoch}")

    def state_dict(self) -> dict:
        """Plain ints and lists (picklable); the token buffer holds at most one row plus one document."""
        return {"epoch": self.epoch, "doc_index": self.doc_index, "dp_rank": self.dp_rank,
                "dp_world_size": self.dp_world_size, "seq_len": self.seq_len, "tokens": list(self._tokens),
                "doc_starts": [i for i, s in enumerate(self._starts) if s]}

    def load_state_dict(self, sd: dict) -> None:
        if not isinstance(sd, dict) or "doc_index" not in sd:
            raise DataError("the saved data loader state has no 'doc_index': it was saved by a loader of a local "
                            "(cached) dataset and cannot resume the streamed (hf) dataset of this run")
        if sd.get("format") == "chat":
            raise DataError("the saved data loader state is that of a streamed chat dataset and cannot resume the "
                            "streamed text dataset of this run; resume with the same training.data_format")
        _check_state_keys(sd, {"epoch": int, "doc_index": int, "dp_rank": int, "dp_world_size": int, "seq_len": int,
                               "tokens": list, "doc_starts": list})
        if (sd["dp_rank"], sd["dp_world_size"]) != (self.dp_rank, self.dp_world_size):
            raise DataError(f"the saved data position of dp rank {sd['dp_rank']} of {sd['dp_world_size']} cannot "
                            f"resume dp rank {self.dp_rank} of {self.dp_world_size}: streamed (hf) datasets are "
                            f"sharded by rank, so resume with the same data-parallel degree")
        if sd["seq_len"] != self.seq_len:
            raise DataError(f"the saved data position was saved with seq_len {sd['seq_len']}, this run has seq_len "
                            f"{self.seq_len}; resume with the same training.seq_len")
        self.epoch, self.doc_index = sd["epoch"], sd["doc_index"]
        self._tokens = list(sd["tokens"])
        self._starts = [False] * len(self._tokens)
        for i in sd["doc_starts"]:
            self._starts[i] = True
        self._docs = None  # reopened at doc_index on the next read


def chat_row(pieces: list[tuple[np.ndarray, np.ndarray]], row_tokens: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One row of whole conversations (harness/data/chat_packing.py): the packed row of their padded window, with
    every label that is not a target of the same conversation set to -100."""
    window, starts, targets = chat_window(pieces, row_tokens, pad_id)
    row = packed_row(torch.from_numpy(window), torch.from_numpy(starts))
    row["labels"][~torch.from_numpy(targets[1:])] = IGNORE_INDEX
    return row


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
        if token_cache.rank_and_world()[0] == 0:  # once per run, not once per rank
            logger.info(f"data: chat rows of {self.cache.folder}: "
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


class ChatStreamPacker(StreamPacker):
    """Chat rows of one DP rank of a Hugging Face stream, packed as they come (harness/data/chat_packing.py); plain
    and exactly resumable: the state is the documents read and the conversation that did not fit the last row."""

    def __init__(self, documents: Callable[[], Iterable[Row]], encoder: ChatEncoder, seq_len: int, batch_size: int,
                 dp_rank: int = 0, dp_world_size: int = 1, infinite: bool = True, overlong: str = "drop",
                 pad_id: int = 0):
        super().__init__(documents, None, seq_len, batch_size, dp_rank, dp_world_size, infinite)
        self.encoder, self.overlong, self.pad_id = encoder, overlong, pad_id
        self._carry: tuple[list[int], list[int]] | None = None  # read, but not yet placed in a row
        self.dropped = self.truncated = self.untargeted = 0

    def _next_row(self) -> dict[str, torch.Tensor]:
        R, pieces, fill = self.seq_len + 1, [], 0
        while fill < R:
            if self._carry is None:
                self._carry = self._next_conversation()
            if fill + len(self._carry[0]) > R:
                break
            pieces.append(self._carry)
            fill += len(self._carry[0])
            self._carry = None
        return chat_row([(np.asarray(ids), np.asarray(flags, dtype=bool)) for ids, flags in pieces], R, self.pad_id)

    def _next_conversation(self) -> tuple[list[int], list[int]]:
        R = self.seq_len + 1
        while True:
            row = self._next_document()
            encoded = row if isinstance(row, Skipped) else self.encoder(row)
            self.encoder.finish()  # ids that differ from apply_chat_template's stop the stream at once
            if isinstance(encoded, Skipped):
                self.skipped += 1
                where = _skipped_where(encoded)
                self._pass.left_out(where)
                _report_left_out(self.skipped, self.dp_rank, "conversations that cannot be trained on", where)
                continue
            ids, flags = encoded
            if len(ids) <= R:
                self._pass.kept += 1  # with a target: the encoder leaves out a conversation without one
                return ids, flags
            if self.overlong == "truncate":
                self.truncated += 1
                if any(flags[:R]):
                    self._pass.kept += 1
                else:  # a row of its own without a label: counted, as in a cache's layout (chat_packing.py)
                    self.untargeted += 1
                    self._pass.left_out(f"{row.locate()}: truncated to seq_len + 1 = {R} tokens, before its first "
                                        f"target (training.chat_overlong = 'truncate')")
                    _report_left_out(self.untargeted, self.dp_rank, "conversations truncated before their first "
                                     "target, each a row without a label,", row.locate(), done="packed")
                return ids[:R], flags[:R]
            self._pass.left_out(f"{row.locate()}: {len(ids)} tokens, longer than seq_len + 1 = {R} "
                                f"(training.chat_overlong = 'drop')")
            self.dropped += 1
            if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                logger.warning(f"data: dp rank {self.dp_rank} dropped {self.dropped} conversations longer than "
                               f"seq_len + 1 = {R} tokens so far (training.chat_overlong = 'drop')")

    def state_dict(self) -> dict:
        carry = None if self._carry is None else [list(self._carry[0]), list(self._carry[1])]
        return {"format": "chat", "epoch": self.epoch, "doc_index": self.doc_index, "dp_rank": self.dp_rank,
                "dp_world_size": self.dp_world_size, "seq_len": self.seq_len, "chat_overlong": self.overlong,
                "carry": carry}

    def load_state_dict(self, sd: dict) -> None:
        if not isinstance(sd, dict) or sd.get("format") != "chat":
            raise DataError("the saved data loader state is not that of a streamed chat dataset: it was saved by a "
                            "text or local (cached) data loader and cannot resume the chat stream of this run")
        _check_state_keys(sd, {"epoch": int, "doc_index": int, "dp_rank": int, "dp_world_size": int, "seq_len": int,
                               "chat_overlong": str})
        if (sd["dp_rank"], sd["dp_world_size"]) != (self.dp_rank, self.dp_world_size):
            raise DataError(f"the saved data position of dp rank {sd['dp_rank']} of {sd['dp_world_size']} cannot "
                            f"resume dp rank {self.dp_rank} of {self.dp_world_size}: streamed (hf) datasets are "
                            f"sharded by rank, so resume with the same data-parallel degree")
        if (sd["seq_len"], sd["chat_overlong"]) != (self.seq_len, self.overlong):
            raise DataError(f"the saved data position was saved with seq_len {sd['seq_len']} and chat_overlong "
                            f"{sd['chat_overlong']!r}, this run has {self.seq_len} and {self.overlong!r}; resume with "
                            f"the same training.seq_len and training.chat_overlong")
        self.epoch, self.doc_index = sd["epoch"], sd["doc_index"]
        self._carry = None if sd["carry"] is None else (list(sd["carry"][0]), list(sd["carry"][1]))
        self._docs = None  # reopened at doc_index on the next read


class _Failure(NamedTuple):
    error: BaseException


class PrefetchingLoader:
    """Runs a packer in a background thread, up to `depth` batches ahead of the consumer.

    The state is that of the batches consumed, not of those prefetched: each batch travels with the packer's
    state right after it. An exception in the thread is raised by the consumer's `next`. Loading a state stops
    the thread; the next `next` starts a fresh one.
    """

    def __init__(self, packer: StreamPacker, depth: int = PREFETCH_BATCHES):
        self.packer, self.depth = packer, depth
        self._state = packer.state_dict()  # after the last batch consumed
        self._queue: queue.Queue | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._final = None  # _END or _Failure once the thread has stopped for good

    def __iter__(self) -> PrefetchingLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._final is None and self._thread is None:
            self._start()
        item = self._final if self._final is not None else self._queue.get()
        if item is _END or isinstance(item, _Failure):
            self._final = item
            if item is _END:
                raise StopIteration
            raise item.error
        batch, self._state = item
        return batch

    def _start(self) -> None:
        self._queue, self._stop = queue.Queue(maxsize=self.depth), threading.Event()
        self._thread = threading.Thread(target=_produce, args=(self.packer, self._queue, self._stop), daemon=True,
                                        name=f"data-prefetch-dp{self.packer.dp_rank}")
        weakref.finalize(self, self._stop.set)  # a dropped loader lets its thread end
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (it ends at its next batch boundary); a later `next` goes on from the last batch
        consumed, so the prefetched batches are packed again rather than lost."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._queue = self._stop = self._thread = None
            self.packer.load_state_dict(self._state)

    def state_dict(self) -> dict:
        return {key: list(value) if isinstance(value, list) else value for key, value in self._state.items()}

    def load_state_dict(self, sd: dict) -> None:
        self.close()  # the thread owns the packer while it runs
        self.packer.load_state_dict(sd)
        self._state, self._final = self.packer.state_dict(), None


def _produce(packer: StreamPacker, out: queue.Queue, stop: threading.Event) -> None:
    try:
        while not stop.is_set():
            batch = packer.next_batch()
            if not _put(out, (batch, packer.state_dict()), stop):
                return
    except StopIteration:
        _put(out, _END, stop)
    except BaseException as e:  # handed to the consumer, which raises it
        _put(out, _Failure(e), stop)


def _put(out: queue.Queue, item, stop: threading.Event) -> bool:
    while not stop.is_set():  # a timeout, so that a stopped loader's thread does not block on a full queue
        try:
            out.put(item, timeout=0.1)
            return True
        except queue.Full:
            pass
    return False


# ---------------------------------------------------------------------------------------------------------------
# Entry point


def build_dataloader(kind: str, path: str, text_field: str, tokenizer, seq_len: int, batch_size: int,
                     dp_rank: int = 0, dp_world_size: int = 1, cache_dir: str | Path | None = None,
                     infinite: bool = True, cache_verify: Verify = "quick", data_format: str = "text",
                     chat: ChatOptions | None = None) -> TokenCacheLoader | PrefetchingLoader:
    """The trainer's entry point; collective over the whole world when torch.distributed is initialized.

    Local kinds need `cache_dir` (the trainer passes training.dataset_cache_dir) and give a TokenCacheLoader over
    the cache, checked as `cache_verify` says (training.dataset_cache_verify); "hf" ignores both and gives a
    PrefetchingLoader over this DP rank's shard. `data_format` "chat": conversations (`chat`: the chat keys, its
    messages_field replaces `text_field`) rendered by the tokenizer's chat template, packed whole into padded rows
    (harness/data/chat_packing.py). Bad data is a DataError (see harness/data/sources.py)."""
    check_source(kind, path)  # fail at build time, not at the first batch
    _check_shape_args(seq_len, batch_size, dp_rank, dp_world_size)
    if data_format == "chat":
        return _build_chat_loader(kind, path, tokenizer, seq_len, batch_size, dp_rank, dp_world_size, cache_dir,
                                  infinite, cache_verify, chat or ChatOptions())
    if data_format != "text":
        raise ValueError(f"data_format {data_format!r}: expected 'text' or 'chat'")
    if kind == "hf":
        documents = functools.partial(hf_documents, path, text_field, dp_rank, dp_world_size)
        return PrefetchingLoader(StreamPacker(documents, tokenizer, seq_len, batch_size, dp_rank, dp_world_size,
                                              infinite))
    if cache_dir is None:
        raise ValueError(f"a cache_dir is needed for the local {kind} dataset {path}: it is tokenized once into "
                         f"that folder (the trainer passes training.dataset_cache_dir)")
    cache = load_token_cache(kind, path, text_field, tokenizer, cache_dir, cache_verify)
    return TokenCacheLoader(cache, seq_len, batch_size, dp_rank, dp_world_size, infinite)


def _build_chat_loader(kind: str, path: str, tokenizer, seq_len: int, batch_size: int, dp_rank: int,
                       dp_world_size: int, cache_dir: str | Path | None, infinite: bool, cache_verify: Verify,
                       chat: ChatOptions) -> TokenCacheLoader | PrefetchingLoader:
    if kind == "text":
        raise DataError("chat data is read from jsonl, parquet or hf datasets (rows holding a list of messages), "
                        "not from text files; set training.dataset accordingly")
    chat = chat.for_rows_of(seq_len)  # the row limit that applies
    encoder = ChatEncoder(tokenizer, chat)  # a DataError when the tokenizer has no chat template
    if kind == "hf":
        documents = functools.partial(hf_documents, path, chat.messages_field, dp_rank, dp_world_size, rows=True,
                                      max_row_bytes=chat.max_row_bytes)
        return PrefetchingLoader(ChatStreamPacker(documents, encoder, seq_len, batch_size, dp_rank, dp_world_size,
                                                  infinite, chat.overlong, pad_id_of(tokenizer)))
    if cache_dir is None:
        raise ValueError(f"a cache_dir is needed for the local {kind} dataset {path}: it is tokenized once into "
                         f"that folder (the trainer passes training.dataset_cache_dir)")
    cache = load_token_cache(kind, path, chat.messages_field, tokenizer, cache_dir, cache_verify, chat, encoder)
    return ChatCacheLoader(cache, seq_len, batch_size, dp_rank, dp_world_size, infinite, chat.overlong,
                           pad_id_of(tokenizer))
