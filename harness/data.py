"""Training data: document sources, packing into fixed-length rows with document boundaries, DP sharding, resume.

Sources (`open_documents(kind, path, text_field)`) yield one string per document:
  text     a .txt file or a folder of them (recursive, sorted); documents are separated by blank lines
  jsonl    a .jsonl file or a folder of them; each non-empty line is a JSON object holding `text_field`
  parquet  a .parquet file or a folder of them; the `text_field` column (needs pyarrow)
  hf       a Hugging Face `datasets` name, streamed from split "train" (needs datasets and hub access)

Packing (`PackedDataLoader`), the contract the model relies on (DESIGN.md, "Packed documents"):
  - each document becomes [bos if the tokenizer has one] + tokens + [eos if it has one]; documents of this
    rank are concatenated into one token stream;
  - row k is the window stream[k*L : k*L + L + 1] (L = seq_len): input_ids = window[:-1], labels = window[1:].
    Windows overlap by one token, so every token is an input once and every next-token pair is a label once;
  - labels are -100 where the next token starts another document: never predict across a boundary;
  - position_ids restart at 0 at every document start and at every row start. A document cut by a row end
    continues in the next row with positions from 0 again: the model treats each row start as a document
    start (GDN state, conv history and attention reset there), the usual cost of packing without padding.
  Batches are dicts of (batch_size, seq_len) int64 tensors: input_ids, labels, position_ids.

Sharding is over data-parallel ranks only (context-parallel ranks of one DP rank share its rows and split
them later): DP rank r reads documents r, r + W, r + 2W, ... so ranks see disjoint data.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import json
import logging
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index
SOURCE_SUFFIXES = {"text": ".txt", "jsonl": ".jsonl", "parquet": ".parquet"}
SOURCE_KINDS = (*SOURCE_SUFFIXES, "hf")
_END = object()  # end of a pass over the documents


# ---------------------------------------------------------------------------------------------------------------
# Document sources


def open_documents(kind: str, path: str, text_field: str = "text") -> Iterator[str]:
    """An iterator over the documents of one source (one full pass); errors about the path are raised here,
    not at the first `next`."""
    _check_source(kind, path)
    if kind == "hf":
        return _hf_documents(path, text_field)
    files = _source_files(Path(path), SOURCE_SUFFIXES[kind])
    readers = {"text": _text_documents, "jsonl": _jsonl_documents, "parquet": _parquet_documents}
    return readers[kind](files, text_field)


def _check_source(kind: str, path: str) -> None:
    if kind not in SOURCE_KINDS:
        raise ValueError(f"unknown dataset kind {kind!r}; expected one of {', '.join(SOURCE_KINDS)}")
    if not path:  # Path("") is the working directory: never read it by accident
        raise ValueError(f"empty dataset path for dataset kind {kind!r}")
    if kind != "hf" and not Path(path).exists():
        raise FileNotFoundError(f"dataset path not found: {path} (a {kind} file or a folder of them)")


def _source_files(path: Path, suffix: str) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(f for f in path.rglob(f"*{suffix}") if f.is_file())  # sorted: same order on every rank
    if not files:
        raise FileNotFoundError(f"no *{suffix} files under {path}")
    return files


def _text_documents(files: list[Path], text_field: str) -> Iterator[str]:
    del text_field  # plain text has no fields
    for file in files:
        with open(file, encoding="utf-8") as f:
            lines: list[str] = []
            for line in f:
                if line.strip():
                    lines.append(line)
                elif lines:
                    yield "".join(lines).rstrip("\n")
                    lines = []
            if lines:
                yield "".join(lines).rstrip("\n")


def _jsonl_documents(files: list[Path], text_field: str) -> Iterator[str]:
    for file in files:
        with open(file, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{file}:{lineno}: not a JSON object ({e.msg})") from None
                if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                    raise ValueError(f"{file}:{lineno}: no string field {text_field!r}; is the text field "
                                     f"of this dataset named differently?")
                yield row[text_field]


def _parquet_documents(files: list[Path], text_field: str) -> Iterator[str]:
    pq = _import_optional("pyarrow.parquet", "pyarrow")
    for file in files:
        pf = pq.ParquetFile(file)
        if text_field not in pf.schema_arrow.names:
            raise ValueError(f"{file}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)})")
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):  # bounded memory on big files
            yield from (text for text in batch.column(0).to_pylist() if text is not None)  # skip null rows


def _hf_documents(name: str, text_field: str) -> Iterator[str]:
    datasets = _import_optional("datasets", "datasets")
    try:  # opened here, eagerly, so an unreachable hub fails at build time with the dataset's name
        ds = datasets.load_dataset(name, split="train", streaming=True)
    except Exception as e:
        raise RuntimeError(f"could not open Hugging Face dataset {name!r} (split 'train', streaming): {e}. "
                           f"Check the name and hub access, or use a local jsonl/parquet copy.") from e

    def rows() -> Iterator[str]:
        for i, row in enumerate(ds):
            if text_field not in row:
                raise ValueError(f"Hugging Face dataset {name!r} row {i}: no field {text_field!r} "
                                 f"(fields: {', '.join(row)})")
            yield row[text_field]

    return rows()


def _import_optional(module: str, package: str):
    # Optional: only the source kinds that need these packages import them.
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"this dataset kind needs the '{package}' package: pip install {package}") from e


# ---------------------------------------------------------------------------------------------------------------
# Packing


class PackedDataLoader:
    """Packs the documents of one DP rank into (batch_size, seq_len) rows; a plain, exactly resumable iterator.

    `documents` opens a fresh pass over the whole source (all ranks' documents) each time it is called; it is
    called once per epoch and again after `load_state_dict`. With infinite=True an exhausted source starts a
    new epoch (the token stream carries on across the epoch boundary); otherwise iteration stops, dropping the
    last partial batch.
    """

    def __init__(self, documents: Callable[[], Iterable[str]], tokenizer, seq_len: int, batch_size: int,
                 dp_rank: int = 0, dp_world_size: int = 1, infinite: bool = True):
        if seq_len < 1 or batch_size < 1:
            raise ValueError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be positive")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_world_size={dp_world_size})")
        self.documents, self.tokenizer = documents, tokenizer
        self.seq_len, self.batch_size = seq_len, batch_size
        self.dp_rank, self.dp_world_size, self.infinite = dp_rank, dp_world_size, infinite
        self.epoch = 0
        self.doc_index = 0  # documents of this rank read in this epoch
        self._tokens: list[int] = []  # stream not yet emitted; _tokens[0] is the next row's first input
        self._starts: list[bool] = []  # per token of _tokens: does a document start there?
        self._docs: Iterator[str] | None = None  # this rank's documents from doc_index on; None = reopen

    def __iter__(self) -> PackedDataLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        rows = [self._next_row() for _ in range(self.batch_size)]  # StopIteration ends a finite loader
        return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}

    def _next_row(self) -> dict[str, torch.Tensor]:
        L = self.seq_len
        while len(self._tokens) < L + 1:
            self._append_document(self._next_document())
        window = torch.tensor(self._tokens[: L + 1], dtype=torch.long)
        starts = torch.tensor(self._starts[: L + 1], dtype=torch.bool)
        del self._tokens[:L], self._starts[:L]  # keep the window's last token: it is the next row's first input
        labels = window[1:].clone()
        labels[starts[1:]] = IGNORE_INDEX  # the next token opens another document
        row_starts = starts[:-1].clone()
        row_starts[0] = True  # every row start is a document start for the model
        idx = torch.arange(L)
        last_start = torch.where(row_starts, idx, 0).cummax(0).values
        return {"input_ids": window[:-1], "labels": labels, "position_ids": idx - last_start}

    def _append_document(self, text: str) -> None:
        bos, eos = self.tokenizer.bos_id, self.tokenizer.eos_id
        ids = ([bos] if bos is not None else []) + self.tokenizer.encode(text) + ([eos] if eos is not None else [])
        if ids:  # an empty document without specials leaves no trace in the stream
            self._tokens += ids
            self._starts += [True] + [False] * (len(ids) - 1)

    def _next_document(self) -> str:
        while True:
            if self._docs is None:  # skip without tokenising: resume costs one read of the skipped documents
                first = self.dp_rank + self.doc_index * self.dp_world_size
                self._docs = itertools.islice(iter(self.documents()), first, None, self.dp_world_size)
            doc = next(self._docs, _END)
            if doc is not _END:
                self.doc_index += 1
                return doc
            if self.doc_index == 0:
                raise ValueError(f"data-parallel rank {self.dp_rank} of {self.dp_world_size} got no documents: "
                                 f"the dataset has fewer documents than data-parallel ranks")
            if not self.infinite:
                raise StopIteration
            self.epoch, self.doc_index, self._docs = self.epoch + 1, 0, None
            logger.info(f"data: dp rank {self.dp_rank} finished the dataset, starting epoch {self.epoch}")

    def state_dict(self) -> dict:
        """Plain ints and lists (picklable); the token buffer holds at most one row plus one document."""
        return {"epoch": self.epoch, "doc_index": self.doc_index, "dp_rank": self.dp_rank,
                "dp_world_size": self.dp_world_size, "tokens": list(self._tokens),
                "doc_starts": [i for i, s in enumerate(self._starts) if s]}

    def load_state_dict(self, sd: dict) -> None:
        if (sd["dp_rank"], sd["dp_world_size"]) != (self.dp_rank, self.dp_world_size):
            raise ValueError(f"data loader state of dp rank {sd['dp_rank']} of {sd['dp_world_size']} cannot "
                             f"resume dp rank {self.dp_rank} of {self.dp_world_size}: documents are sharded by "
                             f"rank, so resume with the same data-parallel degree")
        self.epoch, self.doc_index = sd["epoch"], sd["doc_index"]
        self._tokens = list(sd["tokens"])
        self._starts = [False] * len(self._tokens)
        for i in sd["doc_starts"]:
            self._starts[i] = True
        self._docs = None  # reopened at doc_index on the next read


def build_dataloader(kind: str, path: str, text_field: str, tokenizer, seq_len: int, batch_size: int,
                     dp_rank: int = 0, dp_world_size: int = 1, infinite: bool = True) -> PackedDataLoader:
    """The trainer's entry point: a packed, DP-sharded, resumable loader over one source."""
    _check_source(kind, path)  # fail at build time, not at the first batch
    documents = functools.partial(open_documents, kind, path, text_field)
    return PackedDataLoader(documents, tokenizer, seq_len, batch_size, dp_rank, dp_world_size, infinite)
