"""Tokenized, memory-mapped cache of a local dataset: built once per (dataset, tokenizer), reused by later runs.

Layout of one cache, `<cache_dir>/<key>/`:
  tokens.bin      uint32: the token stream. Every document is [bos] + tokens + [eos] (each special only when the
                  tokenizer has one), documents in source order; an empty document without specials is left out.
  doc_starts.bin  int64: the offset in tokens.bin of every document's first token, ascending.
  targets.bin     chat data only (harness/data/chat.py): uint8, one per token of tokens.bin, 1 where the token is a
                  target (emitted for an assistant turn, or every token with chat_targets "all"), else 0.
  meta.json       written last, human-readable: format version, key, source files (resolved path, size, mtime),
                  tokenizer, token and document counts, the size of each file, the stream's id, and what the
                  checks below compare against: the smallest and largest token id, the sha256 of each file and
                  of a fixed sample of tokens.bin (and of targets.bin), the rows left out (null text, damaged rows,
                  or malformed conversations), and a checksum of meta.json itself.

Key: `<kind>-v<format>-<dataset id>-<tokenizer id>` (`chat-<kind>-...` for chat data), ids hashed from the dataset
identity (kind, text field, resolved files with their sizes and mtimes; for chat data also the messages field, the
chat template's text and chat_targets) and the tokenizer identity (class, sha256 of tokenizer.json for Hugging Face
tokenizers, bos/eos ids, vocab size). Changing either gives a new folder. An edit that keeps a file's size and
mtime is not noticed: hashing every byte would cost a full read of the dataset per run.

Building is collective when torch.distributed is initialized: every rank of the world calls `load_or_build`.
The caller cuts the source into work units that depend only on the files, never on the world size; rank r of
W tokenizes units r, r + W, ... into part files of a temporary folder beside the cache; rank 0 then checks that
every part is there, concatenates them in unit order, writes meta.json last and renames the folder into place.
So the cache is byte-identical whatever the number of ranks that built it. `cache_dir` must be on a filesystem
that every rank sees. A failure on any rank (a bad JSON line, say) is raised on every rank, so no rank is left
waiting at a collective; collectives use the default group only (gloo or NCCL). A token id outside the
tokenizer's vocabulary, or a dataset without documents, fails the build.

Atomic: readers only ever open a renamed, complete folder. A build that fails or is interrupted (an exception,
Ctrl-C, SIGTERM once harness/train.py turns it into an exception) removes its `.<key>.tmp-*` folder; only a
killed one (SIGKILL, power loss) leaves it behind, never read (delete it at leisure). When two jobs race on a
shared filesystem, the first rename wins and the other job discards its own build and uses the winner's.

Checks, every time a cache is opened, on every rank ("quick", well under a second for a 1 GB cache): meta.json
parses and matches its checksum, format, key, dtypes; the files have the recorded sizes, which match the token and
document counts; doc_starts.bin starts at 0, strictly increases, stays below the token count and matches its
sha256 (it is small: 8 bytes a document); the recorded largest token id and those of the sample are inside the
tokenizer's vocabulary; the sample (SAMPLE_BLOCKS evenly spread blocks of SAMPLE_BLOCK_TOKENS tokens; the whole
stream when it is smaller) matches its sha256; targets.bin (chat) has one byte a token and its sample (the same token
ranges) matches its sha256 and holds only 0 and 1. "full" hashes all of tokens.bin (and targets.bin) as well (about
1.5 s a GB): rank 0 runs it right after a build, and on request (training.dataset_cache_verify = "full"). A quick
check misses an in-vocabulary change outside the sample; the loader also checks every row it reads against the
vocabulary (and a chat row's flags against 0 and 1; a 0 turned 1 outside the sample goes unseen but by "full").
A damaged cache is a DataError naming the folder and what failed, and asking to delete the folder. It is not
rebuilt automatically: rebuilding in place could pull files from under another job that is reading them, every
rank would have to agree on it, and a damaged file says something about the storage that its owner should hear.
See docs/design.md, "Token cache".
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Literal, Sequence, TypeVar

import numpy as np

from .encoders import TextEncoder
from .errors import DataError
from .ranks import all_gather, on_every_rank, rank_and_world
from .sources import Skipped

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: token range, file digests, sample digest, skipped rows, meta checksum
TOKENS_FILE, STARTS_FILE, TARGETS_FILE, META_FILE = "tokens.bin", "doc_starts.bin", "targets.bin", "meta.json"
TOKEN_DTYPE, START_DTYPE, TARGET_DTYPE = np.uint32, np.int64, np.uint8
_FLUSH_TOKENS = 1 << 20  # tokens buffered in Python ints before a part file write: bounded build memory
_READ_BYTES = 16 << 20  # block of the checks' and the join's reads: bounded memory whatever the cache's size
# The quick check's sample of tokens.bin: 64 x 256 KiB, 16 MiB read whatever the cache's size (~20 ms from the
# page cache, where a whole 1 GB file costs 1.7 s to read from disk for a max, 1.5 s more for its sha256).
SAMPLE_BLOCKS, SAMPLE_BLOCK_TOKENS = 64, 1 << 16

Verify = Literal["quick", "full"]
T = TypeVar("T")


@dataclass(frozen=True)
class TokenCache:
    """An opened, checked cache: `tokens` and `doc_starts` are read-only memory maps; every token id is below
    `vocab_size` (the tokenizer's, which the model's embedding covers)."""

    folder: Path
    meta: dict
    tokens: np.ndarray  # (num_tokens,) uint32
    doc_starts: np.ndarray  # (num_documents,) int64
    vocab_size: int
    targets: np.ndarray | None = None  # (num_tokens,) uint8, 1 = a target token; chat data only

    @property
    def tokenizer_id(self) -> str:
        return self.meta["tokenizer_id"]

    @property
    def stream_id(self) -> str:
        """Digest of the token stream and document starts: what training reads, whatever the files' paths."""
        return self.meta["stream_id"]


# ---------------------------------------------------------------------------------------------------------------
# Identity


def tokenizer_identity(tokenizer) -> dict:
    identity = {"class": f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}",
                "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "vocab_size": tokenizer.vocab_size}
    path = getattr(tokenizer, "path", None)  # HFTokenizer: the vocabulary and merges live in this file
    if path:
        identity["tokenizer_json_sha256"] = _file_sha256(Path(path))
    return identity


def cache_key(source: dict, tokenizer_id: str) -> str:
    kind = f"{source['format']}-{source['kind']}" if "format" in source else source["kind"]  # text sources: no format
    return f"{kind}-v{FORMAT_VERSION}-{_digest(source)}-{tokenizer_id}"


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _file_sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _stream_id(tokens_sha256: str, starts_sha256: str, targets_sha256: str | None = None) -> str:
    # The same id as format 1's for text, so that a rebuilt cache still resumes the checkpoints of the old one.
    digests = [tokens_sha256, starts_sha256] + ([targets_sha256] if targets_sha256 else [])
    return hashlib.sha256(b"".join(bytes.fromhex(d) for d in digests)).hexdigest()[:16]


def _meta_checksum(meta: dict) -> str:
    return hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True)
                          .encode()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# Open or build


def source_files(source: dict) -> str:
    """The source files a cache was made from, for a log line: the first and how many more."""
    files = [f["path"] for f in source.get("files", [])]
    if not files:
        return "the dataset"
    return files[0] if len(files) == 1 else f"{files[0]} and {len(files) - 1} more file{'s' if len(files) > 2 else ''}"


def load_or_build(cache_dir: str | Path, source: dict, units: Sequence, read_unit: Callable[[object], Iterable],
                  tokenizer, verify: Verify = "quick", encoder=None) -> TokenCache:
    """The cache of `source` (a JSON-able dataset identity) under `tokenizer`, built first if absent, then checked
    (`verify`: see the module docstring).

    `units` are the source's work units in document order; `read_unit(unit)` yields the documents starting in
    one unit (str or a chat Row, or Skipped for a row without text). `encoder` turns one into (ids, target flags or
    None), or Skipped (a row it cannot use): harness/data/encoders.py's TextEncoder(tokenizer) by default, its ChatEncoder
    for chat rows. Collective when torch.distributed is initialized (see the module docstring)."""
    encoder = encoder or TextEncoder(tokenizer)
    if verify not in ("quick", "full"):
        raise ValueError(f"dataset cache verify mode {verify!r}: expected 'quick' or 'full'")
    tok_identity = tokenizer_identity(tokenizer)
    key = cache_key(source, _digest(tok_identity))
    keys = all_gather(key)
    for rank, other in enumerate(keys):
        if other != key:
            raise DataError(f"ranks disagree on the dataset cache key ({key} here, {other} on rank {rank}): do all "
                            f"ranks see the same dataset files (sizes, mtimes) and the same tokenizer?")
    folder = Path(cache_dir) / key
    built = not all(all_gather(folder.exists()))  # build unless every rank sees it; a lost race keeps the winner's
    if built:
        _build(folder, source, tok_identity, units, read_unit, tokenizer, encoder)
    rank = rank_and_world()[0]
    mode = "full" if rank == 0 and (built or verify == "full") else "quick"  # one rank reads every byte
    started = time.perf_counter()
    cache = on_every_rank(lambda: open_cache(folder, tokenizer.vocab_size, mode), f"opening dataset cache {folder}")
    logger.info(f"data: {source_files(source)}: {len(cache.tokens)} tokens, {len(cache.doc_starts)} documents, "
                f"cached in {folder} ({mode} check {time.perf_counter() - started:.2f}s)")
    skipped = cache.meta["skipped_rows"]
    if skipped["count"] and rank == 0:
        what = ("are conversations that cannot be trained on" if cache.targets is not None
                else "have a null text field or are damaged")
        logger.warning(f"data: {skipped['count']} rows of the dataset {what} and were left out (the first: "
                       f"{skipped['first']})")
    return cache


def open_cache(folder: Path, vocab_size: int, verify: Verify = "quick") -> TokenCache:
    """Open a complete cache and check it (see the module docstring); a missing, damaged or incomplete one is a
    DataError naming the folder, what failed and what to do."""
    try:
        return _open_checked(folder, vocab_size, verify)
    except OSError as e:  # a file that cannot be read (permissions, an I/O error) fails the check too
        raise DataError(f"dataset cache {folder} cannot be read ({e}): check its permissions and storage, or delete "
                        f"the folder and the next run rebuilds it") from None


def _open_checked(folder: Path, vocab_size: int, verify: Verify) -> TokenCache:
    meta_path = folder / META_FILE
    if not folder.is_dir():
        raise DataError(f"dataset cache {folder} not found: if another rank built it, the dataset cache folder must "
                        f"be on a filesystem that every rank sees")
    if not meta_path.is_file():
        raise _damaged(folder, f"it has no {META_FILE}, so it is not a complete cache")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _damaged(folder, f"its {META_FILE} is unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("checksum") != _meta_checksum(meta):
        raise _damaged(folder, f"its {META_FILE} does not match its checksum (edited or damaged)")
    if meta.get("format") != FORMAT_VERSION:
        raise _damaged(folder, f"it has format {meta.get('format')}, this code reads format {FORMAT_VERSION}")
    if meta["key"] != folder.name:
        raise _damaged(folder, f"its {META_FILE} belongs to the cache {meta['key']}")
    if (meta["token_dtype"], meta["start_dtype"]) != (np.dtype(TOKEN_DTYPE).name, np.dtype(START_DTYPE).name):
        raise _damaged(folder, f"it records dtypes {meta['token_dtype']}/{meta['start_dtype']}, this code reads "
                               f"{np.dtype(TOKEN_DTYPE).name}/{np.dtype(START_DTYPE).name}")
    expected = _file_bytes(meta["num_tokens"], meta["num_documents"], meta.get("targets") is not None)
    if meta["file_bytes"] != expected or not meta["num_documents"]:  # a build without documents fails
        raise _damaged(folder, f"its {META_FILE} records {meta['num_tokens']} tokens, {meta['num_documents']} "
                               f"documents and file sizes {meta['file_bytes']}, which do not fit together")
    for name, size in expected.items():
        if not (folder / name).is_file():
            raise _damaged(folder, f"{name} is missing")
        actual = (folder / name).stat().st_size
        if actual != size:
            raise _damaged(folder, f"{name} has {actual} bytes where {META_FILE} records {size} (truncated copy?)")
    if not 0 <= meta["token_min"] <= meta["token_max"] < vocab_size:
        raise _damaged(folder, f"{META_FILE} records token ids {meta['token_min']}..{meta['token_max']}, outside "
                               f"the tokenizer's vocabulary of {vocab_size}")
    tokens, starts = _map(folder / TOKENS_FILE, TOKEN_DTYPE), _map(folder / STARTS_FILE, START_DTYPE)
    _check_doc_starts(folder, meta, starts)
    _check_tokens(folder, meta, tokens, vocab_size, verify)
    targets = None
    if meta.get("targets") is not None:
        targets = _map(folder / TARGETS_FILE, TARGET_DTYPE)
        _check_targets(folder, meta, targets, verify)
    targets_sha256 = meta["targets"]["sha256"] if targets is not None else None
    if _stream_id(meta["tokens_sha256"], meta["doc_starts_sha256"], targets_sha256) != meta["stream_id"]:
        raise _damaged(folder, f"its stream id {meta['stream_id']} does not match its files' digests")
    return TokenCache(folder, meta, tokens, starts, vocab_size, targets)


def _file_bytes(num_tokens: int, num_documents: int, with_targets: bool) -> dict[str, int]:
    sizes = {TOKENS_FILE: num_tokens * np.dtype(TOKEN_DTYPE).itemsize,
             STARTS_FILE: num_documents * np.dtype(START_DTYPE).itemsize}
    if with_targets:
        sizes[TARGETS_FILE] = num_tokens * np.dtype(TARGET_DTYPE).itemsize
    return sizes


def _damaged(folder: Path, what: str) -> DataError:
    return DataError(f"dataset cache {folder} is damaged: {what}. Delete the folder (rm -r {folder}) and the next "
                     f"run rebuilds it from the dataset")


def _map(file: Path, dtype) -> np.ndarray:
    if file.stat().st_size == 0:  # mmap refuses empty files
        return np.zeros(0, dtype=dtype)
    return np.memmap(file, dtype=dtype, mode="r")


def _check_doc_starts(folder: Path, meta: dict, starts: np.ndarray) -> None:
    """First 0, strictly increasing (every document holds a token), below the token count, and its sha256."""
    h, previous, step = hashlib.sha256(), -1, _READ_BYTES // starts.itemsize
    for lo in range(0, len(starts), step):
        chunk = np.asarray(starts[lo: lo + step])
        h.update(chunk.tobytes())
        bad = np.flatnonzero(np.diff(chunk, prepend=previous) <= 0)
        if bad.size:
            i = lo + int(bad[0])
            raise _damaged(folder, f"{STARTS_FILE} does not increase at document {i} (offset "
                                   f"{int(starts[i - 1]) if i else 'none'} then {int(starts[i])})")
        previous = int(chunk[-1])
    if int(starts[0]) != 0 or previous >= meta["num_tokens"]:
        raise _damaged(folder, f"{STARTS_FILE} runs from {int(starts[0])} to {previous}, not from 0 to below the "
                               f"{meta['num_tokens']} tokens")
    if h.hexdigest() != meta["doc_starts_sha256"]:
        raise _damaged(folder, f"{STARTS_FILE} does not match its sha256 in {META_FILE}")


def _check_tokens(folder: Path, meta: dict, tokens: np.ndarray, vocab_size: int, verify: Verify) -> None:
    sample = meta["tokens_sample"]
    digest, low, high = _tokens_digest(tokens, _sample_ranges(len(tokens), sample["blocks"], sample["block_tokens"]))
    if high >= vocab_size:
        raise _damaged(folder, f"{TOKENS_FILE} holds token id {high}, outside the tokenizer's vocabulary of "
                               f"{vocab_size}")
    if digest != sample["sha256"]:
        raise _damaged(folder, f"{TOKENS_FILE} does not match the sha256 of its sample in {META_FILE}")
    if verify == "full":
        digest, low, high = _tokens_digest(tokens, [(0, len(tokens))])
        if digest != meta["tokens_sha256"] or (low, high) != (meta["token_min"], meta["token_max"]):
            raise _damaged(folder, f"{TOKENS_FILE} does not match its sha256 in {META_FILE} (token ids {low}..{high}, "
                                   f"recorded {meta['token_min']}..{meta['token_max']})")


def _check_targets(folder: Path, meta: dict, targets: np.ndarray, verify: Verify) -> None:
    """The sample of targets.bin (the tokens' sample ranges) matches its sha256 and holds only 0 and 1; "full":
    the whole file matches its sha256."""
    sample = meta["tokens_sample"]
    ranges = _sample_ranges(len(targets), sample["blocks"], sample["block_tokens"])
    if verify == "full":
        ranges = [(0, len(targets))]
    digest, _, high = _tokens_digest(targets, ranges)
    if high > 1:
        raise _damaged(folder, f"{TARGETS_FILE} holds the value {high} where only 0 and 1 belong")
    expected = meta["targets"]["sha256"] if verify == "full" else meta["targets"]["sample_sha256"]
    if digest != expected:
        raise _damaged(folder, f"{TARGETS_FILE} does not match its sha256 in {META_FILE}")


def _sample_ranges(num_tokens: int, blocks: int, block_tokens: int) -> list[tuple[int, int]]:
    """`blocks` evenly spread token ranges of `block_tokens`, first and last included; the whole stream if it is
    no larger. They depend on the token count only: the build and every check read the same ones."""
    if num_tokens <= blocks * block_tokens:
        return [(0, num_tokens)]
    span = num_tokens - block_tokens
    return [(lo, lo + block_tokens) for lo in (i * span // (blocks - 1) for i in range(blocks))]


def _tokens_digest(tokens: np.ndarray, ranges: list[tuple[int, int]]) -> tuple[str, int, int]:
    """sha256 of the tokens (or target flags) in `ranges`, concatenated, and their smallest and largest value."""
    h, low, high, step = hashlib.sha256(), np.iinfo(np.int64).max, -1, _READ_BYTES // tokens.itemsize
    for start, stop in ranges:
        for lo in range(start, stop, step):
            block = np.asarray(tokens[lo: min(lo + step, stop)])
            h.update(block.tobytes())
            low, high = min(low, int(block.min())), max(high, int(block.max()))
    return h.hexdigest(), low, high


# ---------------------------------------------------------------------------------------------------------------
# Build


def _build(folder: Path, source: dict, tok_identity: dict, units: Sequence, read_unit, tokenizer, encoder) -> None:
    rank, world = rank_and_world()
    started = time.perf_counter()
    # One temporary folder for the whole world, named by rank 0; beside the cache so that the rename stays on
    # one filesystem.
    tmp = folder.parent / all_gather(f".{folder.name}.tmp-{uuid.uuid4().hex[:12]}")[0]
    try:
        mine = list(range(rank, len(units), world))
        on_every_rank(lambda: _tokenize_units(tmp, units, mine, read_unit, tokenizer, encoder),
                      "tokenizing the dataset")
        logger.info(f"data: rank {rank} tokenized {len(mine)} of {len(units)} work units into {tmp}")
        def finish():
            if rank == 0:
                with _writing(tmp):
                    _finish(tmp, folder, source, tok_identity, len(units), encoder.with_targets)

        on_every_rank(finish, f"writing the dataset cache {folder}")
    finally:
        # Every rank: after a failure every rank is past its writes (on_every_rank gathers), after an interruption
        # (Ctrl-C, SIGTERM) no collective is safe and each rank cleans up alone. After a publish there is no tmp.
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info(f"data: built dataset cache {folder} with {world} rank(s) in {time.perf_counter() - started:.1f}s")


def _part(tmp: Path, index: int, suffix: str) -> Path:
    return tmp / f"part-{index:08d}.{suffix}"


def _tokenize_units(tmp: Path, units: Sequence, indices: list[int], read_unit, tokenizer, encoder) -> None:
    vocab = tokenizer.vocab_size
    if vocab > np.iinfo(TOKEN_DTYPE).max + 1:
        raise DataError(f"tokenizer vocab_size {vocab} does not fit the cache's uint32 tokens")
    for name in ("bos_id", "eos_id"):
        special = getattr(tokenizer, name)
        if special is not None and not 0 <= special < vocab:
            raise DataError(f"the tokenizer's {name} {special} is outside its vocabulary of {vocab} ids")
    with _writing(tmp):
        tmp.mkdir(parents=True, exist_ok=True)
        for index in indices:
            _write_part(tmp, index, units[index], read_unit(units[index]), tokenizer, encoder)
    encoder.finish()


@contextlib.contextmanager
def _writing(tmp: Path):
    """An OSError while writing the cache (no permission, a full disk) names the folder; the sources' reading
    errors are DataErrors already."""
    try:
        yield
    except OSError as e:
        raise DataError(f"cannot write the dataset cache under {tmp.parent} ({e}); set training.dataset_cache_dir "
                        f"to a writable folder with room for 4 bytes a token") from None


def _write_part(tmp: Path, index: int, unit, documents: Iterable, tokenizer, encoder) -> None:
    lengths, pending, pending_targets, skipped = [], [], [], {"count": 0, "first": None}
    encoder.start_unit()
    targets_out = open(_part(tmp, index, "targets"), "wb") if encoder.with_targets else contextlib.nullcontext()
    with open(_part(tmp, index, "tokens"), "wb") as out, targets_out:
        for document in documents:
            encoded = document if isinstance(document, Skipped) else encoder(document)
            if isinstance(encoded, Skipped):
                if skipped["first"] is None:
                    reason = f": {encoded.reason}" if encoded.reason else ""
                    skipped["first"] = encoded.locate() + reason
                skipped["count"] += 1
                continue
            ids, targets = encoded
            if len(ids) == 0:  # an empty document without specials leaves no trace in the stream
                continue
            lengths.append(len(ids))
            if isinstance(ids, np.ndarray):  # a long text document, in pieces: written as it is, not buffered
                _flush(out, targets_out, pending, pending_targets, tokenizer, unit)
                out.write(_checked_ids(ids, tokenizer, unit).tobytes())
                continue
            pending += ids
            if encoder.with_targets:
                pending_targets += targets
            if len(pending) >= _FLUSH_TOKENS:
                _flush(out, targets_out, pending, pending_targets, tokenizer, unit)
        _flush(out, targets_out, pending, pending_targets, tokenizer, unit)
    np.asarray(lengths, dtype=START_DTYPE).tofile(_part(tmp, index, "lengths"))
    _part(tmp, index, "skipped").write_text(json.dumps(skipped))


def _flush(out, targets_out, pending: list[int], pending_targets: list[int], tokenizer, unit) -> None:
    out.write(_checked_ids(pending, tokenizer, unit).tobytes())
    pending.clear()
    if pending_targets:
        targets_out.write(np.asarray(pending_targets, dtype=TARGET_DTYPE).tobytes())
        pending_targets.clear()


def _checked_ids(ids: list[int], tokenizer, unit) -> np.ndarray:
    """The ids as uint32, once each is known to be inside the tokenizer's vocabulary (which the model's embedding
    covers: harness/config/run_requirements.py): an id beyond it would index past the embedding or train a row never
    decoded."""
    array = np.asarray(ids, dtype=np.int64)
    if array.size and not 0 <= array.min() <= array.max() < tokenizer.vocab_size:
        bad = int(array[(array < 0) | (array >= tokenizer.vocab_size)][0])
        name = getattr(tokenizer, "path", None) or type(tokenizer).__name__
        raise DataError(f"the tokenizer ({name}) gave token id {bad} for text of {getattr(unit, 'file', unit)}, "
                        f"outside its vocabulary of {tokenizer.vocab_size} ids: its vocab_size disagrees with its "
                        f"ids; fix or replace the tokenizer")
    return array.astype(TOKEN_DTYPE)


def _finish(tmp: Path, folder: Path, source: dict, tok_identity: dict, num_units: int, with_targets: bool) -> None:
    """Rank 0: stitch the parts in unit order, write meta.json last, rename the folder into place."""
    missing = [i for i in range(num_units) if not _part(tmp, i, "skipped").is_file()]  # written last of a part
    if missing:
        raise DataError(f"rank 0 does not see the part files of work units {missing[:5]} in {tmp}: the dataset "
                        f"cache folder must be on a filesystem that every rank sees")
    num_tokens, num_docs, low, high, num_targets = 0, 0, np.iinfo(np.int64).max, -1, 0
    skipped = {"count": 0, "first": None}
    tokens_hash, starts_hash, targets_hash = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
    targets_out = open(tmp / TARGETS_FILE, "wb") if with_targets else contextlib.nullcontext()
    with open(tmp / TOKENS_FILE, "wb") as tokens_out, open(tmp / STARTS_FILE, "wb") as starts_out, targets_out:
        for i in range(num_units):
            with open(_part(tmp, i, "tokens"), "rb") as part:
                for block in iter(lambda: part.read(_READ_BYTES), b""):
                    ids = np.frombuffer(block, dtype=TOKEN_DTYPE)
                    low, high = min(low, int(ids.min())), max(high, int(ids.max()))
                    tokens_hash.update(block)
                    tokens_out.write(block)
            if with_targets:
                with open(_part(tmp, i, "targets"), "rb") as part:
                    for block in iter(lambda: part.read(_READ_BYTES), b""):
                        num_targets += int(np.count_nonzero(np.frombuffer(block, dtype=TARGET_DTYPE)))
                        targets_hash.update(block)
                        targets_out.write(block)
            lengths = np.fromfile(_part(tmp, i, "lengths"), dtype=START_DTYPE)
            starts = (num_tokens + np.cumsum(lengths) - lengths).astype(START_DTYPE)
            starts_hash.update(starts.tobytes())
            starts_out.write(starts.tobytes())
            num_tokens, num_docs = num_tokens + int(lengths.sum()), num_docs + len(lengths)
            part_skipped = json.loads(_part(tmp, i, "skipped").read_text())
            skipped = {"count": skipped["count"] + part_skipped["count"],
                       "first": skipped["first"] or part_skipped["first"]}
            for suffix in ("tokens", "lengths", "skipped") + (("targets",) if with_targets else ()):
                _part(tmp, i, suffix).unlink()
        for out in (tokens_out, starts_out) + ((targets_out,) if with_targets else ()):
            out.flush()
            os.fsync(out.fileno())  # on disk before meta.json says the cache is complete
    if num_docs == 0:
        raise DataError(_no_documents(source, skipped))
    sample_ranges = _sample_ranges(num_tokens, SAMPLE_BLOCKS, SAMPLE_BLOCK_TOKENS)
    targets = None
    if with_targets:
        targets = {"sha256": targets_hash.hexdigest(), "num_targets": num_targets,
                   "sample_sha256": _tokens_digest(_map(tmp / TARGETS_FILE, TARGET_DTYPE), sample_ranges)[0]}
    meta = {
        "format": FORMAT_VERSION, "key": folder.name, "source": source, "tokenizer": tok_identity,
        "tokenizer_id": _digest(tok_identity),
        "stream_id": _stream_id(tokens_hash.hexdigest(), starts_hash.hexdigest(),
                                targets["sha256"] if targets else None),
        "num_tokens": num_tokens, "num_documents": num_docs,
        "token_dtype": np.dtype(TOKEN_DTYPE).name, "start_dtype": np.dtype(START_DTYPE).name,
        "file_bytes": _file_bytes(num_tokens, num_docs, with_targets),
        "token_min": low, "token_max": high,
        "tokens_sha256": tokens_hash.hexdigest(), "doc_starts_sha256": starts_hash.hexdigest(),
        "tokens_sample": {"blocks": SAMPLE_BLOCKS, "block_tokens": SAMPLE_BLOCK_TOKENS,
                          "sha256": _tokens_digest(_map(tmp / TOKENS_FILE, TOKEN_DTYPE), sample_ranges)[0]},
        "skipped_rows": skipped,
    }
    if with_targets:  # text caches keep exactly the meta.json they had before chat data existed
        meta["targets"] = targets
    meta["checksum"] = _meta_checksum(meta)
    with open(tmp / META_FILE, "w", encoding="utf-8") as f:
        f.write(json.dumps(meta, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    publish(tmp, folder)


def _no_documents(source: dict, skipped: dict) -> str:
    files = source.get("files", [])
    what = f"{files[0]['path']}" + (f" and {len(files) - 1} more files" if len(files) > 1 else "") if files else "?"
    if source.get("format") == "chat":
        why = (f"all its {skipped['count']} rows are conversations that cannot be trained on (the first: "
               f"{skipped['first']})" if skipped["count"] else "its files are empty or hold only blank lines")
        return f"the chat {source.get('kind')} dataset {what} holds no conversations: {why}; nothing to train on"
    why = (f"all its {skipped['count']} rows have a null text field or are damaged (the first: {skipped['first']})"
           if skipped["count"] else "its files are empty or hold only blank lines")
    return f"the {source.get('kind')} dataset {what} holds no documents: {why}; nothing to train on"


def publish(tmp: Path, folder: Path) -> None:
    """Rename a finished build into place; if another job got there first, keep its cache and drop ours."""
    try:
        os.rename(tmp, folder)  # atomic; fails when folder exists and is not empty
    except OSError:
        if not folder.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        logger.info(f"data: dataset cache {folder} was published by another job meanwhile; using that one")
