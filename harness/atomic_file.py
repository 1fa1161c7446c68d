"""Text files written whole: into a temporary file beside the file, then renamed over it, so that a reader, or a
process killed mid-write, finds the old file or the new one, never part of one. A leaf module (the standard library
only), which the launcher, the workers, the checkpointer and the metrics all use.

The temporary file gets a fresh random name and is created with O_EXCL (which never follows a symbolic link): in a
folder others can write into, a name planted there in advance (a link to another file of the user's) is never
opened, so the write can only ever land in the file this call creates. The rename replaces a link at `path` itself,
never the file it points to.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_whole(path: str | Path, text: str | bytes, durable: bool = False) -> None:
    """`text` (or bytes, written as they are) into `path` by a rename. `durable`: flushed to the disk before the rename, for files that must survive
    a machine crash as well (a checkpoint's COMPLETE record, the metrics a resume rewrites)."""
    path = Path(path)
    tmp = path.with_name(f"tmp.{path.name}.{secrets.token_hex(6)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)  # umask applies
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
