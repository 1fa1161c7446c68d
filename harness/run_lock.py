"""One run per dump folder: an OS lock on <dump_folder>/.lock, held from before the run writes anything there until
it ends.

Two runs in one folder (a second launch by mistake, a requeued job racing a straggler) would interleave their
metrics.jsonl lines, save checkpoints over each other's and prune each other's; the second is refused instead, with
a RunLockError (exit 2) naming the holder: the lock file records its host, pid and start time.

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
import time
from fcntl import LOCK_EX, LOCK_NB, LOCK_UN, flock
from typing import IO

LOCK_FILE = ".lock"
_HOLDER_WAIT_S = 2.0  # how long a refused launch waits for a holder that has just taken the lock to sign it


class RunLockError(RuntimeError):
    """The dump folder is held by another run, or cannot be locked; the message names the holder or the cause."""


class RunLock:
    """The held lock (rank 0's; other ranks hold none). `release` is idempotent; the process ending releases it
    too, and so does this object being collected (the file closes)."""

    def __init__(self, file: IO[str] | None = None):
        self._file = file

    @property
    def held(self) -> bool:
        return self._file is not None

    def release(self) -> None:
        if self._file is not None:
            flock(self._file.fileno(), LOCK_UN)
            self._file.close()
            self._file = None


def acquire_run_lock(dump_folder: str, rank: int, group=None) -> RunLock:
    """Rank 0 locks `dump_folder` (creating it) and every rank learns the verdict. `group`: a CPU (gloo) process
    group over all ranks that carries it, or None for one process. Raises RunLockError on every rank when refused;
    no rank has written anything into the folder by then."""
    lock, refusal = RunLock(), None
    if rank == 0:
        try:
            lock = _lock(dump_folder)
        except RunLockError as err:
            refusal = str(err)
    if group is not None:
        import torch.distributed as dist

        verdict = [refusal]
        dist.broadcast_object_list(verdict, src=0, group=group)
        refusal = verdict[0]
    if refusal is not None:
        raise RunLockError(refusal)
    return lock


def _lock(dump_folder: str) -> RunLock:
    folder = os.path.abspath(dump_folder)
    path = os.path.join(folder, LOCK_FILE)
    try:
        os.makedirs(folder, exist_ok=True)
        # "a+": never truncated by opening (the holder's record must stay readable); close-on-exec, as Python opens
        # every file, so no program the run starts keeps the lock after the run ends.
        file = open(path, "a+")
    except OSError as e:
        raise RunLockError(f"cannot lock {path}: {e.strerror}; choose another job.dump_folder") from None
    try:
        flock(file.fileno(), LOCK_EX | LOCK_NB)
    except BlockingIOError:
        holder = _holder(file)
        file.close()
        raise RunLockError(f"{folder} is in use by {holder}; wait for it, stop it, or choose another "
                           f"job.dump_folder") from None
    except OSError as e:  # a file system without locks
        file.close()
        raise RunLockError(f"cannot lock {path}: {e.strerror}; choose a job.dump_folder on a file system with "
                           f"file locks") from None
    file.seek(0)
    file.truncate()
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    file.write(json.dumps(record) + "\n")
    file.flush()
    return RunLock(file)


def _holder(file: IO[str]) -> str:
    """Who holds the lock, from its record. A holder that has only just taken it may not have written its record
    yet, and a dead earlier holder's may still be there: while the record names no live process of this host, read
    it again for a moment."""
    deadline, named = time.monotonic() + _HOLDER_WAIT_S, None
    while True:
        file.seek(0)
        try:
            record = json.loads(file.read())
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
