"""Faults a checkpoint meets in the field, made on purpose: bytes flipped inside one tensor of a saved step, a file
system that runs out of space in the middle of a write, a process killed by SIGKILL in the middle of a save.

`python -m tests.checkpoint_faults FRACTION TRAINER_FLAGS...` runs the trainer (harness.train) and SIGKILLs it
during its second checkpoint save, FRACTION of the first save's duration after the save began (past the save's end:
while it waits, after it)."""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystem


def tensor_region(step_dir: Path, key: str, data_file: str | None = None) -> tuple[Path, int, int]:
    """(file, offset, length) of the bytes DCP stored for `key` (in `data_file`, if given: a rank's shard)."""
    storage = FileSystemReader(str(step_dir)).read_metadata().storage_data
    for index, info in storage.items():
        if index.fqn == key and (data_file is None or info.relative_path == data_file):
            return step_dir / info.relative_path, info.offset, info.length
    raise KeyError(f"{step_dir} stores no {key}" + (f" in {data_file}" if data_file else ""))


def flip_bytes(path: Path, offset: int, count: int = 64) -> None:
    """Invert `count` bytes of `path` from `offset` on (size and modification time aside, nothing else changes)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(count)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def flip_tensor_bytes(step_dir: Path, key: str, data_file: str | None = None, count: int = 64) -> Path:
    """Invert `count` bytes in the middle of the stored tensor `key` (inside its values, past torch.save's headers);
    returns the file changed."""
    path, offset, length = tensor_region(step_dir, key, data_file)
    flip_bytes(path, offset + length // 2, count)
    return path


class _FillsUp:
    """A file being written on a file system that has `room` bytes left: the write that would pass it writes what
    fits, then fails as a full disk does."""

    def __init__(self, raw, room: int):
        self.raw, self.room = raw, room

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if data.nbytes > self.room:
            self.raw.write(data[: self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= data.nbytes
        return self.raw.write(data)

    def __getattr__(self, name):  # tell, flush, fileno, close, ...: the file's own
        return getattr(self.raw, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.raw.close()


def disk_fills_during_dcp_writes(monkeypatch, under: str, room: int = 100_000) -> None:
    """DCP's writes of files whose path contains `under` fail once `room` bytes of each are written (ENOSPC)."""
    original = FileSystem.create_stream

    @contextmanager
    def create_stream(self, path, mode):
        with original(self, path, mode) as stream:
            yield _FillsUp(stream, room) if "w" in mode and under in str(path) else stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)


def disk_fills_during_hf_writes(monkeypatch, room: int = 100_000) -> None:
    """The safetensors shards of HF exports and conversions fail once `room` bytes of each are written (ENOSPC)."""
    import builtins

    from models.qwen35_moe import hf_checkpoint

    def fills_up(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        return _FillsUp(f, room) if "w" in mode and str(path).endswith(".safetensors") else f

    monkeypatch.setattr(hf_checkpoint, "open", fills_up, raising=False)


def _kill_during_second_save(fraction: float) -> None:
    from harness.checkpoint.checkpointer import Checkpointer

    original, first = Checkpointer.save, []

    def save(self, step, run_id=None):
        if not first:  # time the first save: the second is about as long
            start = time.perf_counter()
            path = original(self, step, run_id)
            first.append(time.perf_counter() - start)
            return path
        threading.Timer(fraction * first[0], os.kill, (os.getpid(), signal.SIGKILL)).start()
        original(self, step, run_id)
        time.sleep(600)  # the kill comes here at the latest

    Checkpointer.save = save


if __name__ == "__main__":
    _kill_during_second_save(float(sys.argv[1]))
    from harness.train import main

    sys.exit(main(sys.argv[2:]))
