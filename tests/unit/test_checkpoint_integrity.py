"""Checkpoint checksums (harness/checkpoint/integrity.py): the digest of a file, against hashlib on its chunks."""

from __future__ import annotations

import hashlib
import random

import pytest

from harness.checkpoint.integrity import file_digest


@pytest.mark.parametrize("size", [0, 1, 4096, 4097, 4096 * 3 + 1000])
@pytest.mark.parametrize("threads", [1, 3])
def test_a_file_digest_is_the_sha256_of_its_chunks_sha256(tmp_path, size, threads):
    data = random.Random(size).randbytes(size)
    path = tmp_path / "file"
    path.write_bytes(data)
    chunks = [data[i:i + 4096] for i in range(0, size, 4096)] or [b""]
    expected = hashlib.sha256(b"".join(hashlib.sha256(c).digest() for c in chunks)).hexdigest()
    assert file_digest(path, threads, chunk_bytes=4096) == {"bytes": size, "sha256": expected}
