"""One run per dump folder: an OS lock on <dump_folder>/.lock, held from before the run writes anything there until
it ends; and on every other folder the run writes into (harness/run_folders.py `written_folders`): the checkpoint
folder, and the TensorBoard and profiling folders where a path leads them out of the dump folder. A lock covers what
lies under its folder: once it holds its own, a run is refused if another run holds a folder above one of its
folders or under it (`--job.dump_folder RUN/hf` while RUN trains, or a dump folder holding a running run's).

Two runs in one folder (a second launch by mistake, a requeued job racing a straggler) would interleave their
metrics.jsonl lines, save checkpoints over each other's and prune each other's; the second is refused instead, with
a RunLockError (exit 2) naming the holder: the lock file records its host, pid and start time. The checkpoint folder
is locked even inside the dump folder, so that two runs whose paths lead to one checkpoint folder (an absolute
`checkpoint.folder`, or one inside another run's dump folder) meet there too. The shared dataset cache is not locked:
runs are meant to share it, and its build takes care of two runs building it at once (harness/data/token_cache.py).

The lock file is opened without following a symbolic link and must be a regular file with no other name: in a dump
folder others can write into, a `.lock` planted as a link to another file of the user's is refused, never written.

The lock is `fcntl.flock`: the kernel releases it when the holder's process ends, however it ends (SIGKILL, a
crash), so a dead run never blocks the next launch and there is no stale lock to clean up. The file stays when the
run ends: deleting it would let a launch that had already opened it lock a file no longer under that name, beside a
third launch locking the new one.

Multi-process: rank 0 takes the lock and broadcasts its verdict over the CPU group, so every rank raises the same
RunLockError, and only rank 0 holds a file. Multi-node: where flock works across nodes (NFS v4, Lustre mounted with
`flock`, GPFS) the lock excludes a run on any node; elsewhere (Lustre's `localflock`, NFS v3 with `nolock`) it is
per node, and a second job whose rank 0 sits on another node is not seen. Either way rank 0 holding it covers the
whole job: only one job's rank 0 can hold it.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from fcntl import LOCK_EX, LOCK_NB, LOCK_SH, LOCK_UN, flock
from typing import IO

from .run_folders import folders_under

LOCK_FILE = ".lock"
_HOLDER_WAIT_S = 2.0  # how long a refused launch waits for a holder that has just taken the lock to sign it


class RunLockError(RuntimeError):
    """The dump folder is held by another run, or cannot be locked; the message names the holder or the cause."""


class RunLock:
    """The held locks (rank 0's; other ranks hold none). `release` is idempotent; the process ending releases them
    too, and so does this object being collected (the files close)."""

    def __init__(self, files: list[IO[bytes]] | None = None):
        self._files = list(files or [])

    @property
    def held(self) -> bool:
        return bool(self._files)

    def release(self) -> None:
        while self._files:
            file = self._files.pop()
            flock(file.fileno(), LOCK_UN)
            file.close()


def acquire_run_lock(folders: str | dict[str, str], rank: int, group=None) -> RunLock:
    """Rank 0 locks each folder (creating it) and every rank learns the verdict. `folders`: the dump folder, or
    {config key: folder} (`written_folders`; the key names the setting to change when refused). `group`: a CPU
    (gloo) process group over all ranks that carries it, or None for one process. Raises RunLockError on every rank
    when one is refused (the others taken are released); no rank has written anything into them by then."""
    if isinstance(folders, str):
        folders = {"job.dump_folder": folders}
    lock, refusal = RunLock(), None
    if rank == 0:
        files, own = [], {}  # {real path: (key, folder as given)}; two keys leading to one folder: one lock
        for key, folder in folders.items():
            own.setdefault(os.path.realpath(folder), (key, folder))
        try:
            for real, (key, _) in own.items():  # before anything is created: nothing written inside a held folder
                _refuse_held_above(real, key, set(own))
            for key, folder in own.values():
                files.append(_lock(folder, key))
            # Again once this run holds its own: of two runs starting at once in nested folders, the later to look
            # sees the other's lock (both may refuse; neither goes on beside the other)
            for real, (key, _) in own.items():
                _refuse_held_above(real, key, set(own))
                _refuse_held_below(real, key, set(own))
            lock = RunLock(files)
        except RunLockError as err:
            RunLock(files).release()
            refusal = str(err)
    if group is not None:
        import torch.distributed as dist

        verdict = [refusal]
        dist.broadcast_object_list(verdict, src=0, group=group)
        refusal = verdict[0]
    if refusal is not None:
        raise RunLockError(refusal)
    return lock


def _lock(folder: str, key: str) -> IO[bytes]:
    folder = os.path.abspath(folder)
    path = os.path.join(folder, LOCK_FILE)
    try:
        os.makedirs(folder, exist_ok=True)
        # Never truncated by opening (the holder's record must stay readable); never through a link; close-on-exec,
        # so no program the run starts keeps the lock after the run ends.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        why = ("it is a symbolic link, which a lock file never is; remove it, or" if os.path.islink(path)
               else f"{e.strerror};")
        raise RunLockError(f"cannot lock {path}: {why} choose another {key}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:  # a FIFO, a device, or a hard link to another file
        os.close(fd)
        raise RunLockError(f"cannot lock {path}: it is not a plain file of its own (a hard link, a device or a "
                           f"pipe), which a lock file never is; remove it, or choose another {key}")
    file = os.fdopen(fd, "rb+", buffering=0)  # unbuffered: a write the disk refuses fails at once, and only once
    try:
        flock(file.fileno(), LOCK_EX | LOCK_NB)
    except BlockingIOError:
        holder = _holder(file)
        file.close()
        raise RunLockError(f"{folder} is in use by {holder}; wait for it, stop it, or choose another {key}") from None
    except OSError as e:  # a file system without locks
        file.close()
        raise RunLockError(f"cannot lock {path}: {e.strerror}; choose a {key} on a file system with file "
                           f"locks") from None
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        file.truncate(0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    except OSError as e:  # a full disk: the run could not write anything else there either
        file.close()
        raise RunLockError(f"cannot lock {path}: {e.strerror}; free space, or choose another {key}") from None
    return file


def _refuse_held_above(folder: str, key: str, own: set[str]) -> None:
    """RunLockError if another run holds a folder above `folder` (a real path): a run's lock covers what lies under
    its folder."""
    above = os.path.dirname(folder)
    while True:
        holder = None if above in own else _held_by_another(os.path.join(above, LOCK_FILE))
        if holder is not None:
            raise RunLockError(f"{folder} lies inside {above}, which is in use by {holder}: a run's folder covers "
                               f"everything under it; choose another {key}")
        if os.path.dirname(above) == above:
            return
        above = os.path.dirname(above)


def _refuse_held_below(folder: str, key: str, own: set[str]) -> None:
    """RunLockError if another run holds a folder under `folder` (a real path), of those run_folders.folders_under
    looks at."""
    for root, files in folders_under(folder):
        if root == folder or LOCK_FILE not in files or os.path.realpath(root) in own:
            continue
        holder = _held_by_another(os.path.join(root, LOCK_FILE))
        if holder is not None:
            raise RunLockError(f"{folder} holds {root}, which is in use by {holder}: a run's folder may not hold "
                               f"another running run's; choose another {key}")


def _held_by_another(path: str) -> str | None:
    """Who holds the lock file `path`, if another process does; None if none does, or there is no such plain file.
    Tested with a shared lock taken and dropped at once: it never blocks the holder, and a run locking the file in
    that instant is refused as if the two overlapped, which they do."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb", buffering=0) as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            flock(fd, LOCK_SH | LOCK_NB)
        except BlockingIOError:
            return _holder(file)
        except OSError:  # a file system without locks: nothing to learn here
            return None
        flock(fd, LOCK_UN)
    return None


def _holder(file: IO[bytes]) -> str:
    """Who holds the lock, from its record. A holder that has only just taken it may not have written its record
    yet, and a dead earlier holder's may still be there: while the record names no live process of this host, read
    it again for a moment."""
    deadline, named = time.monotonic() + _HOLDER_WAIT_S, None
    while True:
        file.seek(0)
        try:
            record = json.loads(file.read().decode(errors="replace"))
            host, pid = record["host"], int(record["pid"])
            named = f"the run on host {host}, pid {pid}, started {record['started']}"
            if host != socket.gethostname() or _alive(pid):
                return named
        except (ValueError, KeyError, TypeError):
            pass
        if time.monotonic() > deadline:
            return named or "another run (its lock file names none)"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
