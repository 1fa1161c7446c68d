"""Tokenized, memory-mapped cache of a local dataset: built once per (dataset, tokenizer), reused by later runs.

Layout of one cache, `<cache_dir>/<key>/`:
  tokens.bin      uint32: the token stream. Every document is [bos] + tokens + [eos] (each special only when the
                  tokenizer has one), documents in source order; an empty document without specials is left out.
  doc_starts.bin  int64: the offset in tokens.bin of every document's first token, ascending.
  meta.json       written last, human-readable: format version, key, source files (resolved path, size, mtime),
                  tokenizer, token and document counts, the size of each file, and a digest of the stream.

Key: `<kind>-v<format>-<dataset id>-<tokenizer id>`, ids hashed from the dataset identity (kind, text field,
resolved files with their sizes and mtimes) and the tokenizer identity (class, sha256 of tokenizer.json for
Hugging Face tokenizers, bos/eos ids, vocab size). Changing either gives a new folder. An edit that keeps a
file's size and mtime is not noticed: hashing every byte would cost a full read of the dataset per run.

Building is collective when torch.distributed is initialized: every rank of the world calls `load_or_build`.
The caller cuts the source into work units that depend only on the files, never on the world size; rank r of
W tokenizes units r, r + W, ... into part files of a temporary folder beside the cache; rank 0 then checks that
every part is there, concatenates them in unit order, writes meta.json last and renames the folder into place.
So the cache is byte-identical whatever the number of ranks that built it. `cache_dir` must be on a filesystem
that every rank sees. A failure on any rank (a bad JSON line, say) is raised on every rank, so no rank is left
waiting at a collective; collectives use the default group only (gloo or NCCL).

Atomic: readers only ever open a renamed, complete folder. An interrupted build leaves a `.<key>.tmp-*` folder
that is never read (delete it at leisure). When two jobs race on a shared filesystem, the first rename wins and
the other job discards its own build and uses the winner's (they are identical).
Damaged caches are not rebuilt: a folder without meta.json, or whose files do not have the sizes meta.json
records (a truncated copy), is an error naming the folder and asking to delete it. Rebuilding in place could
pull files from under another job that is reading them.
See docs/design.md, "Packed documents".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence, TypeVar

import numpy as np

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
TOKENS_FILE, STARTS_FILE, META_FILE = "tokens.bin", "doc_starts.bin", "meta.json"
TOKEN_DTYPE, START_DTYPE = np.uint32, np.int64
_FLUSH_TOKENS = 1 << 20  # tokens buffered in Python ints before a part file write: bounded build memory

T = TypeVar("T")


@dataclass(frozen=True)
class TokenCache:
    """An opened cache: `tokens` and `doc_starts` are read-only memory maps."""

    folder: Path
    meta: dict
    tokens: np.ndarray  # (num_tokens,) uint32
    doc_starts: np.ndarray  # (num_documents,) int64

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
    return f"{source['kind']}-v{FORMAT_VERSION}-{_digest(source)}-{tokenizer_id}"


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _file_sha256(file: Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# Collectives (default group; a no-op in one process)


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank_and_world() -> tuple[int, int]:
    dist = _dist()
    return (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)


def _all_gather(obj) -> list:
    dist = _dist()
    if dist is None:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def on_every_rank(step: Callable[[], T], what: str) -> T:
    """Run `step` here, then fail on every rank if it failed on any. Collective: every rank calls it, in the same
    order. Without it a failing rank would leave the others waiting at the next collective until a timeout."""
    result, error = None, None
    try:
        result = step()
    except Exception as e:  # not BaseException: Ctrl-C stops this rank as usual
        error = e
    failures = _all_gather(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    for rank, failure in enumerate(failures):
        if failure is not None:
            raise RuntimeError(f"{what} failed on rank {rank}: {failure}")
    return result


# ---------------------------------------------------------------------------------------------------------------
# Open or build


def load_or_build(cache_dir: str | Path, source: dict, units: Sequence, read_unit: Callable[[object], Iterable[str]],
                  tokenizer) -> TokenCache:
    """The cache of `source` (a JSON-able dataset identity) under `tokenizer`, built first if absent.

    `units` are the source's work units in document order; `read_unit(unit)` yields the documents starting in
    one unit. Collective when torch.distributed is initialized (see the module docstring)."""
    tok_identity = tokenizer_identity(tokenizer)
    key = cache_key(source, _digest(tok_identity))
    keys = _all_gather(key)
    for rank, other in enumerate(keys):
        if other != key:
            raise ValueError(f"ranks disagree on the dataset cache key ({key} here, {other} on rank {rank}): do all "
                             f"ranks see the same dataset files (sizes, mtimes) and the same tokenizer?")
    folder = Path(cache_dir) / key
    if not all(_all_gather(folder.exists())):  # build unless every rank sees it; a lost race keeps the winner's
        _build(folder, source, tok_identity, units, read_unit, tokenizer)
    cache = open_cache(folder)
    logger.info(f"data: dataset cache {folder}: {len(cache.tokens)} tokens, {len(cache.doc_starts)} documents")
    return cache


def open_cache(folder: Path) -> TokenCache:
    """Open a complete cache; a damaged or incomplete one is a ValueError naming the folder."""
    meta_path = folder / META_FILE
    if not folder.is_dir():
        raise FileNotFoundError(f"dataset cache {folder} not found: if another rank built it, the dataset cache "
                                f"folder must be on a filesystem that every rank sees")
    if not meta_path.is_file():
        raise ValueError(f"dataset cache {folder} has no {META_FILE}, so it is not a complete cache: delete the "
                         f"folder and it will be rebuilt")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"dataset cache {folder}: unreadable {META_FILE} ({e}); delete the folder and it will be "
                         f"rebuilt") from None
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"dataset cache {folder} has format {meta.get('format')}, this code reads format "
                         f"{FORMAT_VERSION}; delete the folder and it will be rebuilt")
    for name, size in meta["file_bytes"].items():
        actual = (folder / name).stat().st_size if (folder / name).is_file() else None
        if actual != size:
            raise ValueError(f"dataset cache {folder} is damaged: {name} has {actual} bytes where {META_FILE} "
                             f"records {size} (truncated copy?); delete the folder and it will be rebuilt")
    return TokenCache(folder, meta, _map(folder / TOKENS_FILE, TOKEN_DTYPE), _map(folder / STARTS_FILE, START_DTYPE))


def _map(file: Path, dtype) -> np.ndarray:
    if file.stat().st_size == 0:  # mmap refuses empty files
        return np.zeros(0, dtype=dtype)
    return np.memmap(file, dtype=dtype, mode="r")


def _build(folder: Path, source: dict, tok_identity: dict, units: Sequence, read_unit, tokenizer) -> None:
    rank, world = rank_and_world()
    started = time.perf_counter()
    # One temporary folder for the whole world, named by rank 0; beside the cache so that the rename stays on
    # one filesystem.
    tmp = folder.parent / _all_gather(f".{folder.name}.tmp-{uuid.uuid4().hex[:12]}")[0]
    try:
        mine = list(range(rank, len(units), world))
        on_every_rank(lambda: _tokenize_units(tmp, units, mine, read_unit, tokenizer), "tokenizing the dataset")
        logger.info(f"data: rank {rank} tokenized {len(mine)} of {len(units)} work units into {tmp}")
        finish = lambda: _finish(tmp, folder, source, tok_identity, len(units)) if rank == 0 else None
        on_every_rank(finish, f"writing the dataset cache {folder}")
    finally:
        if rank == 0:  # every rank is past its writes here (on_every_rank gathers): safe to remove
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info(f"data: built dataset cache {folder} with {world} rank(s) in {time.perf_counter() - started:.1f}s")


def _part(tmp: Path, index: int, suffix: str) -> Path:
    return tmp / f"part-{index:08d}.{suffix}"


def _tokenize_units(tmp: Path, units: Sequence, indices: list[int], read_unit, tokenizer) -> None:
    if tokenizer.vocab_size > np.iinfo(TOKEN_DTYPE).max + 1:
        raise ValueError(f"tokenizer vocab_size {tokenizer.vocab_size} does not fit the cache's uint32 tokens")
    tmp.mkdir(parents=True, exist_ok=True)
    for index in indices:
        _write_part(tmp, index, read_unit(units[index]), tokenizer)


def _write_part(tmp: Path, index: int, documents: Iterable[str], tokenizer) -> None:
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    lengths, pending = [], []
    with open(_part(tmp, index, "tokens"), "wb") as out:
        for text in documents:
            ids = bos + tokenizer.encode(text) + eos
            if ids:  # an empty document without specials leaves no trace in the stream
                pending += ids
                lengths.append(len(ids))
            if len(pending) >= _FLUSH_TOKENS:
                out.write(np.asarray(pending, dtype=TOKEN_DTYPE).tobytes())
                pending.clear()
        out.write(np.asarray(pending, dtype=TOKEN_DTYPE).tobytes())
    np.asarray(lengths, dtype=START_DTYPE).tofile(_part(tmp, index, "lengths"))


def _finish(tmp: Path, folder: Path, source: dict, tok_identity: dict, num_units: int) -> None:
    """Rank 0: stitch the parts in unit order, write meta.json last, rename the folder into place."""
    missing = [i for i in range(num_units) if not _part(tmp, i, "lengths").is_file()]
    if missing:
        raise FileNotFoundError(f"rank 0 does not see the part files of work units {missing[:5]} in {tmp}: the "
                                f"dataset cache folder must be on a filesystem that every rank sees")
    num_tokens, num_docs = 0, 0
    tokens_hash, starts_hash = hashlib.sha256(), hashlib.sha256()
    with open(tmp / TOKENS_FILE, "wb") as tokens_out, open(tmp / STARTS_FILE, "wb") as starts_out:
        for i in range(num_units):
            with open(_part(tmp, i, "tokens"), "rb") as part:
                for block in iter(lambda: part.read(16 << 20), b""):
                    tokens_hash.update(block)
                    tokens_out.write(block)
            lengths = np.fromfile(_part(tmp, i, "lengths"), dtype=START_DTYPE)
            starts = (num_tokens + np.cumsum(lengths) - lengths).astype(START_DTYPE)
            starts_hash.update(starts.tobytes())
            starts_out.write(starts.tobytes())
            num_tokens, num_docs = num_tokens + int(lengths.sum()), num_docs + len(lengths)
            _part(tmp, i, "tokens").unlink()
            _part(tmp, i, "lengths").unlink()
        for out in (tokens_out, starts_out):
            out.flush()
            os.fsync(out.fileno())  # on disk before meta.json says the cache is complete
    meta = {
        "format": FORMAT_VERSION, "key": folder.name, "source": source, "tokenizer": tok_identity,
        "tokenizer_id": _digest(tok_identity),
        "stream_id": hashlib.sha256(tokens_hash.digest() + starts_hash.digest()).hexdigest()[:16],
        "num_tokens": num_tokens, "num_documents": num_docs,
        "token_dtype": np.dtype(TOKEN_DTYPE).name, "start_dtype": np.dtype(START_DTYPE).name,
        "file_bytes": {TOKENS_FILE: num_tokens * np.dtype(TOKEN_DTYPE).itemsize,
                       STARTS_FILE: num_docs * np.dtype(START_DTYPE).itemsize},
    }
    with open(tmp / META_FILE, "w", encoding="utf-8") as f:
        f.write(json.dumps(meta, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    publish(tmp, folder)


def publish(tmp: Path, folder: Path) -> None:
    """Rename a finished build into place; if another job got there first, keep its cache and drop ours."""
    try:
        os.rename(tmp, folder)  # atomic; fails when folder exists and is not empty
    except OSError:
        if not folder.exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        logger.info(f"data: dataset cache {folder} was published by another job meanwhile; using that one")
