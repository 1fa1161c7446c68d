"""The dataset cache's checks on a synthetic cache of --gib GiB of tokens: the time to open it with the quick check and
with the full one, from the page cache (warm) and from disk (cold: the files dropped from the page cache first).

    python benchmarks/cache_check.py [--gib 1] [--folder /tmp/cache_check] [--doc-tokens 1000]

The cache is built by harness/data/token_cache.py's own join (one part file of random ids below the 35B-A3B
vocabulary, documents of --doc-tokens tokens), so its meta.json is what a real build records. CPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from harness.data import token_cache

VOCAB = 248_320  # Qwen3.5's


def build(folder: Path, gib: float, doc_tokens: int) -> Path:
    tmp, cache = folder / ".bench.tmp", folder / "bench"
    shutil.rmtree(folder, ignore_errors=True)
    tmp.mkdir(parents=True)
    num_tokens = int(gib * (1 << 30)) // 4
    rng = np.random.default_rng(0)
    with open(token_cache._part(tmp, 0, "tokens"), "wb") as out:
        for lo in range(0, num_tokens, 1 << 24):  # 64 MiB at a time
            out.write(rng.integers(0, VOCAB, min(1 << 24, num_tokens - lo), dtype=np.uint32).tobytes())
    lengths = np.full(num_tokens // doc_tokens, doc_tokens, dtype=np.int64)
    lengths[-1] += num_tokens - int(lengths.sum())
    lengths.tofile(token_cache._part(tmp, 0, "lengths"))
    token_cache._part(tmp, 0, "skipped").write_text(json.dumps({"count": 0, "first": None}))
    started = time.perf_counter()
    token_cache._finish(tmp, cache, {"kind": "bench"}, {"vocab_size": VOCAB}, 1)
    print(f"join, digests and meta.json: {time.perf_counter() - started:.2f} s")
    return cache


def drop_from_page_cache(cache: Path) -> None:
    for name in (token_cache.TOKENS_FILE, token_cache.STARTS_FILE):
        fd = os.open(cache / name, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--folder", default="/tmp/cache_check")
    parser.add_argument("--doc-tokens", type=int, default=1000)
    args = parser.parse_args()
    cache = build(Path(args.folder), args.gib, args.doc_tokens)
    for verify in ("quick", "full"):
        for state in ("cold", "warm"):
            if state == "cold":
                drop_from_page_cache(cache)
            started = time.perf_counter()
            token_cache.open_cache(cache, VOCAB, verify)
            print(f"{verify:5s} {state}: {time.perf_counter() - started:.3f} s")
    shutil.rmtree(args.folder, ignore_errors=True)


if __name__ == "__main__":
    main()
