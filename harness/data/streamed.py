"""Rows of a Hugging Face stream (hf), text and chat: each data-parallel rank reads its shard (datasets.distributed.
split_dataset_by_node) and packs it on its own as the documents come, with no cache. Their rows therefore DO depend
on the number of data-parallel ranks, and their state resumes only at the same DP rank and degree, by skipping
(reading without tokenizing) the consumed documents. The packers run in a background thread
(harness/data/prefetch.py), as far ahead of the training step as its queue allows.

Text rows are windows of the rank's token stream (harness/data/rows.py); chat rows whole conversations in padded rows,
the conversation that did not fit the last row carried to the next (harness/data/chat_packing.py).
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from .chat import ChatOptions
from .chat_packing import pad_id_of
from .encoders import ChatEncoder, TextEncoder
from .errors import DataError
from .rows import chat_row, check_loader_args, packed_row, stack_rows
from .saved_position import STREAMED_CHAT, STREAMED_TEXT, check_saved_position
from .sources import Row, Skipped, hf_documents

logger = logging.getLogger(__name__)

END = object()  # the end of a sequence: a pass over the documents; a finite stream's batches (prefetch.py)


def _report_left_out(count: int, dp_rank: int, what: str, latest: str, done: str = "left out") -> None:
    """A stream's rows left out so far, logged at the 1st, 10th, 100th and every 1000th: a stream has no end to
    report them at, and a line per row would flood the log."""
    if count in (1, 10, 100) or count % 1000 == 0:
        logger.warning(f"data: dp rank {dp_rank} {done} {count} {what} so far (the latest: {latest})")


class _PassTally:
    """A stream's rows kept (with a target, for chat) and not in one pass over its documents: a whole pass (read
    from its first row) that kept none is an error, where reading on would only pass over the same rows again."""

    def __init__(self, whole: bool):
        self.whole, self.kept, self.first_left_out = whole, 0, None

    def left_out(self, where: str) -> None:
        self.first_left_out = self.first_left_out or where


class StreamPacker:
    """Packs the documents of one DP rank into rows as they come (hf streams); plain and exactly resumable.

    `documents` opens a fresh pass over this rank's documents each time it is called: once per epoch, and again
    after `load_state_dict`. With infinite=True an exhausted source starts a new epoch (the token stream carries
    on across the epoch boundary); otherwise `next_batch` raises StopIteration, dropping the last partial batch.
    A whole pass that keeps no document (every row null or damaged) is a DataError naming the first.
    """

    def __init__(self, documents: Callable[[], Iterable[str]], tokenizer, seq_len: int, batch_size: int,
                 dp_rank: int = 0, dp_world_size: int = 1, infinite: bool = True):
        check_loader_args(seq_len, batch_size, dp_rank, dp_world_size)
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
        return stack_rows([self._next_row() for _ in range(self.batch_size)])  # StopIteration ends a finite packer

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
            self._leave_out(text, "rows with a null text field, or damaged,")
            return
        ids, _ = self.encoder(text)
        ids = ids if isinstance(ids, list) else ids.tolist()  # a long document comes in an array
        if ids:  # an empty document without specials leaves no trace in the stream
            self._tokens += ids
            self._starts += [True] + [False] * (len(ids) - 1)
            self._pass.kept += 1

    def _leave_out(self, skipped: Skipped, what: str) -> None:
        """Counts a row left out (`what`: rows of its kind, for the log line)."""
        self.skipped += 1
        where = f"{skipped.locate()}: {skipped.reason or 'a null text field'}"
        self._pass.left_out(where)
        _report_left_out(self.skipped, self.dp_rank, what, where)

    def _next_document(self) -> str | Skipped:
        while True:
            if self._docs is None:  # skip without tokenising: resume costs one read of the skipped documents
                self._docs = itertools.islice(iter(self.documents()), self.doc_index, None)
                self._pass = _PassTally(whole=self.doc_index == 0)
            doc = next(self._docs, END)
            if doc is not END:
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
        sd = check_saved_position(
            sd, STREAMED_TEXT, {"epoch": int, "doc_index": int, "tokens": list, "doc_starts": list},
            {"dp_rank": self.dp_rank, "dp_world_size": self.dp_world_size, "seq_len": self.seq_len})
        self.epoch, self.doc_index = sd["epoch"], sd["doc_index"]
        self._tokens = list(sd["tokens"])
        self._starts = [False] * len(self._tokens)
        for i in sd["doc_starts"]:
            self._starts[i] = True
        self._docs = None  # reopened at doc_index on the next read


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
                self._leave_out(encoded, "conversations that cannot be trained on")
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
        sd = check_saved_position(
            sd, STREAMED_CHAT, {"epoch": int, "doc_index": int},
            {"dp_rank": self.dp_rank, "dp_world_size": self.dp_world_size, "seq_len": self.seq_len,
             "chat_overlong": self.overlong})
        self.epoch, self.doc_index = sd["epoch"], sd["doc_index"]
        self._carry = None if sd["carry"] is None else (list(sd["carry"][0]), list(sd["carry"][1]))
        self._docs = None  # reopened at doc_index on the next read


def streamed_rows(path: str, text_field: str, tokenizer, seq_len: int, batch_size: int, dp_rank: int,
                  dp_world_size: int, infinite: bool, chat: ChatOptions | None = None,
                  encoder: ChatEncoder | None = None) -> StreamPacker:
    """The packer of this DP rank's shard of the hf dataset `path`: text rows, or with `chat` (its row limit resolved)
    and its `encoder`, chat rows."""
    if chat is None:
        documents = functools.partial(hf_documents, path, text_field, dp_rank, dp_world_size)
        return StreamPacker(documents, tokenizer, seq_len, batch_size, dp_rank, dp_world_size, infinite)
    documents = functools.partial(hf_documents, path, chat.messages_field, dp_rank, dp_world_size, rows=True,
                                  max_row_bytes=chat.max_row_bytes)
    return ChatStreamPacker(documents, encoder, seq_len, batch_size, dp_rank, dp_world_size, infinite, chat.overlong,
                            pad_id_of(tokenizer))
