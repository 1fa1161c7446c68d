"""Text files written whole: into `tmp.<name>` beside the file, then renamed over it, so that a reader, or a process
killed mid-write, finds the old file or the new one, never part of one. A leaf module (the standard library only),
which the launcher, the workers and the checkpointer all use."""

from __future__ import annotations

import os
from pathlib import Path


def write_whole(path: str | Path, text: str, durable: bool = False) -> None:
    """`text` into `path` by a rename. `durable`: flushed to the disk before the rename, for files that must survive
    a machine crash as well (a checkpoint's COMPLETE record, the metrics a resume rewrites)."""
    path = Path(path)
    tmp = path.with_name(f"tmp.{path.name}")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
