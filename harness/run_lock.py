"""One run per dump folder: an OS lock on <dump_folder>/.lock, held from before the run writes anything there until
it ends; and on every other folder the run writes into (`written_folders`): the checkpoint folder, and the
TensorBoard and profiling folders where a path leads them out of the dump folder.

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
from fcntl import LOCK_EX, LOCK_NB, LOCK_UN, flock
from typing import IO

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


def written_folders(cfg) -> dict[str, str]:
    """{config key: folder} of every folder a run of `cfg` writes into and locks: the dump folder, the checkpoint
    folder (when checkpointing), and the TensorBoard / profiling folders that lie outside the dump folder."""
    dump = cfg.job.dump_folder
    folders = {"job.dump_folder": dump}
    if cfg.checkpoint.enable:
        folders["checkpoint.folder"] = os.path.join(dump, cfg.checkpoint.folder)
    outputs = (("metrics.save_tb_folder", cfg.metrics.enable_tensorboard, cfg.metrics.save_tb_folder),
               ("profiling.save_traces_folder", cfg.profiling.enable_profiling, cfg.profiling.save_traces_folder),
               ("profiling.save_memory_snapshot_folder", cfg.profiling.enable_memory_snapshot,
                cfg.profiling.save_memory_snapshot_folder))
    inside = os.path.realpath(dump) + os.sep
    for key, enabled, folder in outputs:
        path = os.path.join(dump, folder)
        if enabled and not (os.path.realpath(path) + os.sep).startswith(inside):
            folders[key] = path
    return folders


def acquire_run_lock(folders: str | dict[str, str], rank: int, group=None) -> RunLock:
    """Rank 0 locks each folder (creating it) and every rank learns the verdict. `folders`: the dump folder, or
    {config key: folder} (`written_folders`; the key names the setting to change when refused). `group`: a CPU
    (gloo) process group over all ranks that carries it, or None for one process. Raises RunLockError on every rank
    when one is refused (the others taken are released); no rank has written anything into them by then."""
    if isinstance(folders, str):
        folders = {"job.dump_folder": folders}
    lock, refusal = RunLock(), None
    if rank == 0:
        files, seen = [], set()
        try:
            for key, folder in folders.items():
                if os.path.realpath(folder) not in seen:  # two keys leading to one folder: one lock
                    seen.add(os.path.realpath(folder))
                    files.append(_lock(folder, key))
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
