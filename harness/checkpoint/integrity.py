"""Checksums of a checkpoint's files: each rank digests the files it wrote once they are written, rank 0 records every
digest in COMPLETE, and the files are checked against it before a resume or a conversion (docs/design.md,
"Checkpoints").

A file's digest is its size and the sha256 of the sha256 digests of its consecutive 64 MiB chunks (the last one
shorter). Chunks, rather than one sha256 over the file, let a file of tens of GiB be hashed by several threads at once
(hashlib releases the GIL on large buffers). sha256 rather than zlib.crc32, which is about 3x faster a thread: both
catch corruption, but only sha256 also holds against a deliberate edit, so that a checkpoint can be checked against
a COMPLETE kept or published elsewhere; and with the SHA extensions of current x86 CPUs it is faster than blake2b.

The files are hashed after DCP has written them (from the page cache), by several threads, not as the bytes stream
past: hashing inline in DCP's one writer thread cost more, on 2 cores and on 16 (docs/performance.md, "Checkpoint
checksums"; benchmarks/checkpoint_integrity.py measures both).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..atomic_file import write_whole

ALGORITHM = "sha256 of 64 MiB chunks' sha256"  # recorded in COMPLETE beside the digests
CHUNK_BYTES = 64 * 2**20
COMPLETE = "COMPLETE"
_DATA_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's per-rank data files: __<rank>_<n>.distcp


def hash_threads() -> int:
    """Threads for hashing one rank's files: this process's share of the node's cores, at most 8 (beyond that the
    file system's read rate, not the hash, bounds it)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def file_digest(path: str | Path, threads: int = 1, chunk_bytes: int = CHUNK_BYTES) -> dict:
    """{"bytes", "sha256"} of a file, its chunks hashed by `threads` threads."""
    size = os.path.getsize(path)
    chunks = max(1, -(-size // chunk_bytes))
    threads = max(1, min(threads, chunks))
    fd = os.open(path, os.O_RDONLY)
    try:
        def digest_chunks(first: int) -> list[tuple[int, bytes]]:  # chunks first, first + threads, ...
            buffer, done = bytearray(min(chunk_bytes, size)), []
            for index in range(first, chunks, threads):
                expected = min(chunk_bytes, size - index * chunk_bytes)
                got = os.preadv(fd, [memoryview(buffer)[:expected]], index * chunk_bytes) if expected else 0
                if got != expected:
                    raise OSError(f"{path}: read {got} of {expected} bytes at offset {index * chunk_bytes}")
                done.append((index, hashlib.sha256(memoryview(buffer)[:got]).digest()))
            return done

        if threads == 1:
            parts = digest_chunks(0)
        else:
            with ThreadPoolExecutor(threads) as pool:
                parts = [part for done in pool.map(digest_chunks, range(threads)) for part in done]
    finally:
        os.close(fd)
    return {"bytes": size, "sha256": hashlib.sha256(b"".join(digest for _, digest in sorted(parts))).hexdigest()}


def digest_files(folder: Path, names: list[str], threads: int) -> dict[str, dict]:
    """{name: digest} of the files `names` (paths relative to `folder`)."""
    return {name: file_digest(folder / name, threads) for name in names}


def rank_data_files(folder: Path, rank: int) -> list[str]:
    """The data files DCP's writer on `rank` wrote into a step folder."""
    return sorted(p.name for p in folder.glob(f"__{rank}_*.distcp"))


def rank_0_files(folder: Path) -> list[str]:
    """What rank 0 writes beside its data files: DCP's .metadata and the hf/ files (config.json, tokenizer)."""
    hf = folder / "hf"
    extra = sorted(str(p.relative_to(folder)) for p in hf.rglob("*") if p.is_file()) if hf.is_dir() else []
    return [".metadata", *extra]


def write_complete(folder: Path, record: dict) -> None:
    """COMPLETE, atomically: a save killed while writing it leaves a tmp.COMPLETE.<random> file, never a truncated COMPLETE."""
    write_whole(folder / COMPLETE, json.dumps(record, indent=1, sort_keys=True) + "\n", durable=True)


def read_complete(folder: Path) -> dict:
    """COMPLETE's record; ValueError if it is not one."""
    try:
        record = json.loads((folder / COMPLETE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"its {COMPLETE} is unreadable ({e})") from None
    files = record.get("files", {}) if isinstance(record, dict) else None
    if not isinstance(files, dict) or not all(isinstance(d, dict) and isinstance(d.get("bytes"), int)
                                              and isinstance(d.get("sha256"), str) for d in files.values()):
        raise ValueError(f"its {COMPLETE} is not a record of this trainer")
    return record


def saved_files(folder: Path) -> list[str]:
    """Every file of a step folder that its COMPLETE must record: each rank's data files, DCP's .metadata and the
    hf/ files."""
    return sorted(p.name for p in folder.glob("__*_*.distcp")) + rank_0_files(folder)


def checked_by(name: str, rank: int, world: int) -> bool:
    """Whether `rank` of `world` checks file `name` of a checkpoint: rank k's data files by rank k % world (at the
    saving world size the rank that wrote them, whose node's page cache may still hold them), the rest by rank 0.
    Each file is read once, by one rank: a rank reads its share, not the whole checkpoint."""
    match = _DATA_FILE.match(name)
    return (int(match.group(1)) if match else 0) % world == rank


def check_files(folder: Path, record: dict, rank: int = 0, world: int = 1, threads: int = 1) -> str | None:
    """The first of this rank's files (`checked_by`) that differs from COMPLETE's record, or that the record leaves
    out, described in a few words; None if all match. A record without digests (saved before they were recorded)
    has nothing to check; one whose map leaves out a file the save wrote (an empty map, say) checks nothing of that
    file, so it fails."""
    if "files" in record:
        unrecorded = [n for n in saved_files(folder) if checked_by(n, rank, world) and n not in record["files"]]
        if unrecorded:
            more = f" (and {len(unrecorded) - 1} more)" if len(unrecorded) > 1 else ""
            return f"{COMPLETE} records no digest for {unrecorded[0]}{more}, which the folder holds"
    for name, want in sorted(record.get("files", {}).items()):
        if not checked_by(name, rank, world):
            continue
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = os.path.getsize(path)
        if size != want.get("bytes"):
            return f"{name} holds {size} bytes, {COMPLETE} records {want.get('bytes')}"
        try:
            got = file_digest(path, threads)["sha256"]
        except OSError as e:
            return f"{name} is unreadable ({e})"
        if got != want.get("sha256"):
            return f"{name} digest {got[:16]}... differs from {COMPLETE}'s {str(want.get('sha256'))[:16]}..."
    return None
