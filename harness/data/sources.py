"""Document sources: local files (text, jsonl, parquet) cut into work units, and streamed Hugging Face datasets.

    open_documents(kind, path, text_field)      every document of a source, in order (one full pass)
    source_units(kind, files, unit_bytes)       the work units of local files: byte ranges cut at document
                                                boundaries, or parquet row groups; they depend on the files only
    read_unit(kind, unit, text_field)           the documents that start in one unit

Kinds:
  text     a .txt file or a folder of them (recursive, sorted); documents are separated by blank lines
  jsonl    a .jsonl file or a folder of them; each non-empty line is a JSON object holding `text_field`
  parquet  a .parquet file or a folder of them; the `text_field` column (needs pyarrow)
  hf       a Hugging Face `datasets` name, streamed from split "train" (needs datasets and hub access)
Errors name the file and line at fault. Packing the documents into rows is harness/data/loader.py's job.
"""

from __future__ import annotations

import importlib
import itertools
import json
from pathlib import Path
from typing import Iterator, NamedTuple

SOURCE_SUFFIXES = {"text": ".txt", "jsonl": ".jsonl", "parquet": ".parquet"}
SOURCE_KINDS = (*SOURCE_SUFFIXES, "hf")

# ---------------------------------------------------------------------------------------------------------------
# Document sources


def open_documents(kind: str, path: str, text_field: str = "text") -> Iterator[str]:
    """An iterator over the documents of one source (one full pass); errors about the path are raised here,
    not at the first `next`."""
    check_source(kind, path)
    if kind == "hf":
        return hf_documents(path, text_field)
    units = source_units(kind, source_files(Path(path), SOURCE_SUFFIXES[kind]))
    return itertools.chain.from_iterable(read_unit(kind, unit, text_field) for unit in units)


def check_source(kind: str, path: str) -> None:
    if kind not in SOURCE_KINDS:
        raise ValueError(f"unknown dataset kind {kind!r}; expected one of {', '.join(SOURCE_KINDS)}")
    if not path:  # Path("") is the working directory: never read it by accident
        raise ValueError(f"empty dataset path for dataset kind {kind!r}")
    if kind != "hf" and not Path(path).exists():
        raise FileNotFoundError(f"dataset path not found: {path} (a {kind} file or a folder of them)")


def source_files(path: Path, suffix: str) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(f for f in path.rglob(f"*{suffix}") if f.is_file())  # sorted: same order on every rank
    if not files:
        raise FileNotFoundError(f"no *{suffix} files under {path}")
    return files


class WorkUnit(NamedTuple):
    """A piece of one source file, tokenized by one rank: for text and jsonl, the documents that start in bytes
    [start, stop) (the last one may run past stop); for parquet, row groups [start, stop)."""

    file: Path
    start: int
    stop: int


def source_units(kind: str, files: list[Path], unit_bytes: int | None = None) -> list[WorkUnit]:
    """The work units of local files, in document order. They depend on the files only, never on the number of
    ranks, so any world builds the same cache. unit_bytes None: one unit per file."""
    units = []
    for file in files:
        if kind == "parquet":  # row groups: parquet's own unit of reading
            length = _parquet_file(file).num_row_groups
            step = 1 if unit_bytes else max(length, 1)
        else:
            length = file.stat().st_size
            step = unit_bytes or max(length, 1)
        units += [WorkUnit(file, start, min(start + step, length)) for start in range(0, length, step)]
    return units


def read_unit(kind: str, unit: WorkUnit, text_field: str = "text") -> Iterator[str]:
    readers = {"text": _text_documents, "jsonl": _jsonl_documents, "parquet": _parquet_documents}
    return readers[kind](unit, text_field)


def _text_documents(unit: WorkUnit, text_field: str) -> Iterator[str]:
    """Documents are runs of non-blank lines; one starts at a non-blank line after a blank one or at byte 0."""
    del text_field  # plain text has no fields
    with open(unit.file, "rb") as f:
        first = _first_line_start(f, unit.start)
        after_blank = first == 0 or _ends_with_blank_line(_line_before(f, first))
        lines: list[str] = []  # the document being read: it started in this unit
        for offset, raw in _lines_from(f, first):
            if offset >= unit.stop and not lines:
                return
            for line in _universal_lines(_decode(raw, unit.file, offset)):
                if _is_blank(line):
                    if lines:
                        yield "".join(lines).rstrip("\n")
                        lines = []
                elif after_blank:  # a document starts here; it belongs to the unit its first line starts in
                    if offset >= unit.stop:
                        return
                    lines = [line]
                elif lines:
                    lines.append(line)
                # else: the rest of a document that started in an earlier unit
                after_blank = _is_blank(line)
        if lines:
            yield "".join(lines).rstrip("\n")


def _jsonl_documents(unit: WorkUnit, text_field: str) -> Iterator[str]:
    with open(unit.file, "rb") as f:
        for offset, raw in _lines_from(f, _first_line_start(f, unit.start)):
            if offset >= unit.stop:
                return
            for i, line in enumerate(_universal_lines(_decode(raw, unit.file, offset))):
                if _is_blank(line):
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{_where(unit.file, offset, i)}: not a JSON object ({e.msg})") from None
                if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                    raise ValueError(f"{_where(unit.file, offset, i)}: no string field {text_field!r}; is the text "
                                     f"field of this dataset named differently?")
                yield row[text_field]


def _parquet_documents(unit: WorkUnit, text_field: str) -> Iterator[str]:
    pf = _parquet_file(unit.file)
    if text_field not in pf.schema_arrow.names:
        raise ValueError(f"{unit.file}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)})")
    row_groups = list(range(unit.start, unit.stop))
    for batch in pf.iter_batches(batch_size=1024, row_groups=row_groups, columns=[text_field]):  # bounded memory
        yield from (text for text in batch.column(0).to_pylist() if text is not None)  # skip null rows


def _parquet_file(file: Path):
    return _import_optional("pyarrow.parquet", "pyarrow").ParquetFile(file)


# Text and jsonl files are read in binary, so that a unit can seek to its byte range, and decoded line by line
# the way open(file, encoding="utf-8") reads: "\r\n" and a lone "\r" end lines too. Binary lines end at b"\n"
# only, which never occurs inside a multi-byte UTF-8 character.


def _first_line_start(f, offset: int) -> int:
    """Offset of the first line that starts at or after `offset` (lines start at 0 and after b"\\n")."""
    if offset == 0:
        return 0
    f.seek(offset - 1)
    f.readline()
    return f.tell()


def _line_before(f, offset: int) -> bytes:
    """The binary line that ends just before `offset` (a line start > 0): found by reading backwards."""
    start = offset - 1  # the b"\n" that ends it
    while start > 0:
        step = min(start, 1 << 16)
        f.seek(start - step)
        newline = f.read(step).rfind(b"\n")
        if newline >= 0:
            start = start - step + newline + 1
            break
        start -= step
    f.seek(start)
    return f.read(offset - start)


def _lines_from(f, offset: int) -> Iterator[tuple[int, bytes]]:
    f.seek(offset)
    for raw in f:
        yield offset, raw
        offset += len(raw)


def _decode(raw: bytes, file: Path, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{_where(file, offset, 0)}: not UTF-8 text ({e.reason})") from None


def _universal_lines(text: str) -> list[str]:
    if "\r" not in text:  # the usual case: one binary line is one line
        return [text]
    parts = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return [part + "\n" for part in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _ends_with_blank_line(raw: bytes) -> bool:
    # Only the blankness of a line of another unit matters here; that unit reports its decoding errors.
    return _is_blank(_universal_lines(raw.decode("utf-8", "replace"))[-1])


def _is_blank(line: str) -> bool:
    return not line.strip()


def _where(file: Path, offset: int, index: int) -> str:
    """`file:line` of the index-th line of the binary line at `offset`."""
    return f"{file}:{_line_number(file, offset) + index}"


def _line_number(file: Path, offset: int) -> int:
    """1-based number, as text mode counts lines, of the line starting at byte `offset`. For error messages
    only: it reads the file up to there, since a unit does not know how many lines precede it."""
    count, cr_before = 0, False
    with open(file, "rb") as f:
        while offset > 0:
            block = f.read(min(offset, 1 << 20))
            offset -= len(block)
            count += block.count(b"\n") + block.count(b"\r") - block.count(b"\r\n")
            if cr_before and block.startswith(b"\n"):  # a "\r\n" split between two blocks counted twice
                count -= 1
            cr_before = block.endswith(b"\r")
    return count + 1


def hf_documents(name: str, text_field: str, dp_rank: int = 0, dp_world_size: int = 1) -> Iterator[str]:
    """The documents of one DP rank's shard of a streamed Hugging Face dataset (the whole stream for 1 rank)."""
    datasets = _import_optional("datasets", "datasets")
    try:  # opened here, eagerly, so an unreachable hub fails with the dataset's name
        ds = datasets.load_dataset(name, split="train", streaming=True)
    except Exception as e:
        raise RuntimeError(f"could not open Hugging Face dataset {name!r} (split 'train', streaming): {e}. "
                           f"Check the name and hub access, or use a local jsonl/parquet copy.") from e
    if dp_world_size > 1:  # whole shards per rank where they divide evenly, else every W-th row: see datasets
        split = _import_optional("datasets.distributed", "datasets").split_dataset_by_node
        ds = split(ds, rank=dp_rank, world_size=dp_world_size)

    def rows() -> Iterator[str]:
        for i, row in enumerate(ds):
            if text_field not in row:
                raise ValueError(f"Hugging Face dataset {name!r} (dp rank {dp_rank} of {dp_world_size}) row {i}: "
                                 f"no field {text_field!r} (fields: {', '.join(row)})")
            yield row[text_field]

    return rows()


def _import_optional(module: str, package: str):
    # Optional: only the source kinds that need these packages import them.
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"this dataset kind needs the '{package}' package: pip install {package}") from e
