"""Document sources: local files (text, jsonl, parquet) cut into work units, and streamed Hugging Face datasets.

    open_documents(kind, path, text_field)      every document of a source, in order (one full pass)
    source_units(kind, files, unit_bytes)       the work units of local files: byte ranges cut at document
                                                boundaries, or parquet row groups; they depend on the files only
    read_unit(kind, unit, text_field)           the documents that start in one unit
    read_unit(kind, unit, field, rows=True)     the whole records that start in one unit, as `Row`s (chat data:
                                                `field` holds the messages; harness/data/chat.py renders them)
                                                and, with max_row_bytes, Skipped for a larger record, unread

Kinds:
  text     a .txt file or a folder of them (recursive, sorted); documents are separated by blank lines
  jsonl    a .jsonl file or a folder of them; each non-empty line is a JSON object holding `text_field`
  parquet  a .parquet file or a folder of them; the `text_field` column (needs pyarrow)
  hf       a Hugging Face `datasets` name, streamed from split "train" (needs datasets and hub access)
Bad input is a DataError naming the file and line (or byte offset, row, field) at fault: a line that is not JSON,
bytes that are not UTF-8, a NUL byte (a binary file), a row without the text field or with a non-string one, a
parquet file that parquet cannot read, a folder without files of the kind. A corrupted file is named, never
trained on. Left out instead, as `Skipped` (counted and reported in one line by the cache build and the stream
packer): a row whose text is null (JSON null, a parquet null), and a damaged row that is valid JSON yet cannot be
used: JSON nested deeper than Python reads, an integer longer than Python converts, or text holding a lone surrogate
(a \ud800 escape, which no tokenizer encodes). Whole records larger than `max_row_bytes` (a jsonl line's bytes, or
the UTF-8 bytes of a parquet or Hugging Face record's strings) are left out the same way before they are decoded or
parsed: a conversation far longer than a row costs seconds and gigabytes to render, only to be dropped or cut.
Whole records (`rows=True`) are fatal only where the file is damaged or `field` is missing; what the record holds
is judged by its renderer (harness/data/chat.py). Packing the documents into rows is the loaders' job
(harness/data/cached.py, harness/data/streamed.py).
"""

from __future__ import annotations

import functools
import importlib
import json
import re
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

from .errors import DataError

SOURCE_SUFFIXES = {"text": ".txt", "jsonl": ".jsonl", "parquet": ".parquet"}
CHAT_ROW_COLUMNS = ("tools",)  # parquet columns read beside the messages of a chat row
SOURCE_KINDS = (*SOURCE_SUFFIXES, "hf")
_BINARY_HINT = "; is it a binary or compressed file? Datasets are read as plain UTF-8 text"
_BLOCK_BYTES = 1 << 20  # what a line longer than a row limit is read in, passed over


class Skipped(NamedTuple):
    """A row left out of the token stream, counted: its text is null, or (`reason`) a damaged row or a conversation
    that cannot be trained on. `locate()` says where (file:line, row); it is called for the first skipped row only,
    as finding a line number reads the file up to it."""

    locate: Callable[[], str]
    reason: str | None = None  # None: a null text field


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_problem(text: str) -> str | None:
    """Why `text` cannot be tokenized, or None: a lone surrogate, which only a JSON \\u escape (or a Python
    object) can hold, never UTF-8 text; tokenizers refuse it."""
    if text.isascii():
        return None
    found = _SURROGATE.search(text)
    return None if found is None else (f"its text holds the lone surrogate \\u{ord(found.group()):04x} (character "
                                       f"{found.start()}), which is not Unicode text: a damaged \\u escape?")


class Row(NamedTuple):
    """A whole record (`read_unit(..., rows=True)`): the JSON object, parquet row or Hugging Face row, and where it
    is (`locate()`, as for Skipped)."""

    value: dict
    locate: Callable[[], str]


# ---------------------------------------------------------------------------------------------------------------
# Document sources


def check_source(kind: str, path: str) -> None:
    if kind not in SOURCE_KINDS:
        raise DataError(f"unknown dataset kind {kind!r}; expected one of {', '.join(SOURCE_KINDS)}")
    if not path:  # Path("") is the working directory: never read it by accident
        raise DataError(f"empty dataset path for dataset kind {kind!r}")
    if kind != "hf" and not Path(path).exists():
        raise DataError(f"dataset path not found: {path} (a {kind} file or a folder of them)")


def source_files(path: Path, suffix: str) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"dataset path {path} is neither a file nor a folder")
    files = sorted(f for f in path.rglob(f"*{suffix}") if f.is_file())  # sorted: same order on every rank
    if not files:
        kind = next(k for k, v in SOURCE_SUFFIXES.items() if v == suffix)
        others = Counter(f.suffix or f.name for f in path.rglob("*") if f.is_file())
        found = ", ".join(f"{n} {name}" for name, n in others.most_common(4)) or "no files at all"
        raise DataError(f"dataset folder {path} holds no *{suffix} files, which a {kind} dataset reads (recursively); "
                        f"it holds {found}. Set the dataset kind to that of its files, or dataset_path to a folder "
                        f"of {suffix} files")
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


def read_unit(kind: str, unit: WorkUnit, text_field: str = "text", rows: bool = False,
              max_row_bytes: int | None = None) -> Iterator[str | Skipped | Row]:
    """The documents that start in `unit`: the `text_field` strings, or with `rows` the whole records holding
    `text_field` (jsonl and parquet only), those larger than `max_row_bytes` Skipped unread."""
    if rows and kind not in ("jsonl", "parquet"):
        raise DataError(f"a {kind} dataset has no records; chat data is read from jsonl, parquet or hf datasets")
    readers = {"text": _text_documents, "jsonl": _jsonl_documents, "parquet": _parquet_documents}
    if rows:
        reader = functools.partial({"jsonl": _jsonl_rows, "parquet": _parquet_rows}[kind], max_row_bytes=max_row_bytes)
    else:
        reader = readers[kind]
    try:
        yield from reader(unit, text_field)
    except OSError as e:  # unreadable (permissions, an I/O error): bad input too, named
        raise DataError(f"{unit.file}: cannot be read ({e.strerror or e})") from None


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


def _jsonl_objects(unit: WorkUnit, holding: str,
                   max_line_bytes: int | None = None) -> Iterator[tuple[dict, Callable[[], str]] | Skipped]:
    """Every JSON object starting in the unit, with its locator, or Skipped for a damaged one or (unread) one whose
    line has more than `max_line_bytes` bytes; a line that is not a JSON object (one `holding` what the reader
    wants) is fatal."""
    with open(unit.file, "rb") as f:
        for offset, raw in _lines_from(f, _first_line_start(f, unit.start), max_line_bytes):
            if offset >= unit.stop:
                return
            if max_line_bytes is not None and len(raw.rstrip(b"\n")) > max_line_bytes:
                yield Skipped(functools.partial(_where, unit.file, offset, 0),
                              f"its line has more than {max_line_bytes} bytes {_ROW_LIMIT}")
                continue
            for i, line in enumerate(_universal_lines(_decode(raw, unit.file, offset))):
                if _is_blank(line):
                    continue
                locate = functools.partial(_where, unit.file, offset, i)
                try:
                    row = json.loads(line.rstrip("\n"))  # a line cut inside a string: "unterminated", not "\n"
                except json.JSONDecodeError as e:
                    raise DataError(f"{locate()}: not a JSON object ({e.msg.removesuffix(' at')} at column "
                                    f"{e.pos + 1}): a damaged or cut-off line?") from None
                except RecursionError:  # valid JSON, but deeper than Python's parser recurses
                    yield Skipped(locate, "its JSON is nested too deeply for Python to read")
                    continue
                except ValueError as e:  # valid JSON Python will not hold: an integer of more than 4300 digits
                    yield Skipped(locate, f"its JSON holds a value Python does not read ({str(e).split(';')[0]})")
                    continue
                if not isinstance(row, dict):
                    raise DataError(f"{locate()}: a JSON {_json_type(row)}, not an object holding {holding}")
                yield row, locate


def _jsonl_documents(unit: WorkUnit, text_field: str) -> Iterator[str | Skipped]:
    for item in _jsonl_objects(unit, f"the text field {text_field!r}"):
        if isinstance(item, Skipped):
            yield item
            continue
        row, locate = item
        text = row.get(text_field)
        if text is None and text_field in row:  # an explicit null: a row without text, not a damaged one
            yield Skipped(locate)
        elif not isinstance(text, str):
            raise DataError(f"{locate()}: " + _field_problem(row, text_field))
        else:
            problem = lone_surrogate_problem(text)
            yield text if problem is None else Skipped(locate, problem)


def _jsonl_rows(unit: WorkUnit, field: str, max_row_bytes: int | None = None) -> Iterator[Row | Skipped]:
    for item in _jsonl_objects(unit, f"the messages field {field!r}", max_row_bytes):
        if isinstance(item, Skipped):
            yield item
            continue
        row, locate = item
        if field not in row:  # the wrong field named in the config, most likely: fatal, unlike a bad value in it
            raise DataError(f"{locate()}: " + _field_problem(row, field, "training.chat_messages_field"))
        yield Row(row, locate)


def _json_type(value) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return names.get(type(value), "null")


def _field_problem(row: dict, text_field: str, key: str = "dataset_text_field") -> str:
    if text_field in row:
        return f"field {text_field!r} is a JSON {_json_type(row[text_field])}, not a string"
    keys = ", ".join(repr(k) for k in list(row)[:8]) + (", ..." if len(row) > 8 else "")
    what = "the messages" if key.endswith("messages_field") else "the text"
    return f"no field {text_field!r} (the row has {keys or 'no fields'}); set {key} to the field that holds {what}"


def _parquet_documents(unit: WorkUnit, text_field: str) -> Iterator[str | Skipped]:
    pa = _import_optional("pyarrow", "pyarrow")
    pf = _parquet_file(unit.file)
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise DataError(f"{unit.file}: no column {text_field!r} (columns: {', '.join(schema.names)}); set "
                        f"dataset_text_field to the column that holds the text")
    column_type = schema.field(text_field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)
            or getattr(pa.types, "is_string_view", lambda t: False)(column_type)):
        raise DataError(f"{unit.file}: column {text_field!r} holds {column_type}, not strings")
    first_row = sum(pf.metadata.row_group(g).num_rows for g in range(unit.start))  # for naming a skipped row
    row_groups = list(range(unit.start, unit.stop))
    try:
        batches = pf.iter_batches(batch_size=1024, row_groups=row_groups, columns=[text_field])  # bounded memory
        for batch in batches:
            for text in batch.column(0).to_pylist():
                yield text if text is not None else Skipped(functools.partial(_row_where, unit.file, first_row))
                first_row += 1
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{unit.file}: row groups {unit.start}-{unit.stop - 1} cannot be read ({e}); a damaged "
                        f"parquet file?") from None


def _parquet_rows(unit: WorkUnit, field: str, max_row_bytes: int | None = None) -> Iterator[Row | Skipped]:
    """Whole parquet rows: the `field` column and, where the file has one, the `tools` column."""
    pa = _import_optional("pyarrow", "pyarrow")
    pf = _parquet_file(unit.file)
    names = pf.schema_arrow.names
    if field not in names:
        raise DataError(f"{unit.file}: no column {field!r} (columns: {', '.join(names)}); set "
                        f"training.chat_messages_field to the column that holds the messages")
    columns = [field] + [c for c in CHAT_ROW_COLUMNS if c in names and c != field]
    first_row = sum(pf.metadata.row_group(g).num_rows for g in range(unit.start))
    try:
        for batch in pf.iter_batches(batch_size=256, row_groups=list(range(unit.start, unit.stop)), columns=columns):
            for row in batch.to_pylist():
                yield _sized_row(row, functools.partial(_row_where, unit.file, first_row), max_row_bytes)
                first_row += 1
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{unit.file}: row groups {unit.start}-{unit.stop - 1} cannot be read ({e}); a damaged "
                        f"parquet file?") from None


# Why a record was left out unread: the key that sets the limit, and its default.
_ROW_LIMIT = ("(training.chat_max_row_bytes: by default 16 bytes a token of a row of seq_len + 1 tokens), far more "
              "than a row holds; left out unread")


def _sized_row(value: dict, locate: Callable[[], str], max_row_bytes: int | None) -> Row | Skipped:
    """The record as a Row, or Skipped when its strings hold more than `max_row_bytes` UTF-8 bytes."""
    if max_row_bytes is not None and _larger_than(value, max_row_bytes):
        return Skipped(locate, f"its strings hold more than {max_row_bytes} bytes {_ROW_LIMIT}")
    return Row(value, locate)


def _larger_than(value, limit: int) -> bool:
    """Whether the strings (and keys) of a record hold more than `limit` UTF-8 bytes, other values 1 byte each;
    it stops as soon as they do, and walks without recursion (a record may be nested deep)."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) if item.isascii() else len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, dict):
            stack += item.keys()
            stack += item.values()
        elif isinstance(item, (list, tuple)):
            stack += item
        else:
            total += 1
        if total > limit:
            return True
    return False


def _row_where(file: Path, row: int) -> str:
    return f"{file}: row {row}"


def _parquet_file(file: Path):
    pa = _import_optional("pyarrow", "pyarrow")
    try:
        return _import_optional("pyarrow.parquet", "pyarrow").ParquetFile(file)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{file}: not a readable parquet file ({e})") from None


# Text and jsonl files are read in binary, so that a unit can seek to its byte range, and decoded line by line
# the way open(file, encoding="utf-8") reads: "\r\n" and a lone "\r" end lines too. Binary lines end at b"\n"
# only, which never occurs inside a multi-byte UTF-8 character.


def _first_line_start(f, offset: int) -> int:
    """Offset of the first line that starts at or after `offset` (lines start at 0 and after b"\\n")."""
    if offset == 0:
        return 0
    f.seek(offset - 1)
    while (block := f.readline(_BLOCK_BYTES)) and not block.endswith(b"\n"):  # a line of any length, in blocks
        pass
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


def _lines_from(f, offset: int, max_bytes: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of each binary line from `offset` on. With `max_bytes`, a line longer than that is yielded
    cut to max_bytes + 2 bytes (enough to tell it is longer): the rest is passed over, never held."""
    f.seek(offset)
    if max_bytes is None:
        for raw in f:
            yield offset, raw
            offset += len(raw)
        return
    while raw := f.readline(max_bytes + 2):
        length = len(raw)
        if length == max_bytes + 2 and not raw.endswith(b"\n"):
            while (rest := f.readline(_BLOCK_BYTES)):
                length += len(rest)
                if rest.endswith(b"\n"):
                    break
        yield offset, raw
        offset += length


def _decode(raw: bytes, file: Path, offset: int) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{_where(file, offset, 0)}: not UTF-8 text ({e.reason} at byte {offset + e.start} of the "
                        f"file){_BINARY_HINT}") from None
    if "\0" in text:  # valid UTF-8, yet no text file holds NUL: zeroed or binary bytes
        raise DataError(f"{_where(file, offset, 0)}: a NUL byte at byte {offset + raw.index(0)} of the file"
                        f"{_BINARY_HINT}")
    return text


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


def hf_documents(name: str, text_field: str, dp_rank: int = 0, dp_world_size: int = 1, rows: bool = False,
                 max_row_bytes: int | None = None) -> Iterator[str | Skipped | Row]:
    """The documents of one DP rank's shard of a streamed Hugging Face dataset (the whole stream for 1 rank); with
    `rows`, its whole records (`Row`), each holding `text_field`, those larger than `max_row_bytes` Skipped."""
    datasets = _import_optional("datasets", "datasets")
    try:  # opened here, eagerly, so an unreachable hub fails with the dataset's name
        ds = datasets.load_dataset(name, split="train", streaming=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"could not open Hugging Face dataset {name!r} (split 'train', streaming): {first}. "
                        f"Check the name and hub access, or use a local jsonl/parquet copy.") from e
    if dp_world_size > 1:  # whole shards per rank where they divide evenly, else every W-th row: see datasets
        split = _import_optional("datasets.distributed", "datasets").split_dataset_by_node
        ds = split(ds, rank=dp_rank, world_size=dp_world_size)

    def records() -> Iterator[Row | Skipped]:
        for i, row in enumerate(ds):
            locate = functools.partial(_hf_where, name, dp_rank, dp_world_size, i)
            if text_field not in row:
                raise DataError(f"{locate()}: " + _field_problem(row, text_field, "training.chat_messages_field"))
            yield _sized_row(row, locate, max_row_bytes)

    def texts() -> Iterator[str | Skipped]:
        for i, row in enumerate(ds):
            text = row.get(text_field)
            locate = functools.partial(_hf_where, name, dp_rank, dp_world_size, i)
            if isinstance(text, str):
                problem = lone_surrogate_problem(text)
                yield text if problem is None else Skipped(locate, problem)
            elif text is None and text_field in row:
                yield Skipped(locate)
            else:
                raise DataError(f"{locate()}: " + _field_problem(row, text_field))

    return records() if rows else texts()


def _hf_where(name: str, dp_rank: int, dp_world_size: int, row: int) -> str:
    return f"Hugging Face dataset {name!r} (dp rank {dp_rank} of {dp_world_size}) row {row}"


def _import_optional(module: str, package: str):
    # Optional: only the source kinds that need these packages import them.
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"this dataset kind needs the '{package}' package: pip install {package}") from None
