"""One run per dump folder (harness/run_lock.py): a second launch is refused at once naming the holder, leaves the
first run's outputs as they were, and a killed holder's lock is free at once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.run_lock import LOCK_FILE, RunLockError, acquire_run_lock
from harness.train import BAD_INPUT, main

REPO = Path(__file__).resolve().parents[2]
FAST = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false",
        "--checkpoint.export_hf_at_end", "false"]


def holder_of(folder: Path, pid: int, timeout: float = 60) -> dict:
    """The lock record of `folder` once process `pid` has written it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            record = json.loads((folder / LOCK_FILE).read_text())
            if record["pid"] == pid:
                return record
        except (OSError, ValueError):
            pass
        time.sleep(0.005)
    raise AssertionError(f"process {pid} never locked {folder}")


def test_a_second_launch_into_a_held_folder_exits_2_naming_the_holder_and_the_first_run_finishes(tmp_path, capsys):
    """Two launches on one dump folder: the first (run_train.sh, held still with SIGSTOP once it has the lock, so the
    second surely meets it) keeps it; the second exits 2 within seconds with one line naming host, pid and start
    time, having written nothing; the first then finishes and its checkpoint loads."""
    folder = tmp_path / "run"
    run = [*FAST, "--training.steps", "3", "--checkpoint.enable", "true", "--checkpoint.interval", "3",
           "--job.dump_folder", str(folder)]
    env = {**os.environ, "NGPU": "1", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([str(REPO / "run_train.sh"), *run], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        record = holder_of(folder, first.pid)
        os.kill(first.pid, signal.SIGSTOP)
        before = sorted(p.relative_to(folder) for p in folder.rglob("*"))
        capsys.readouterr()
        started = time.monotonic()
        assert main(run) == BAD_INPUT
        assert time.monotonic() - started < 5  # a running holder's record is read at once
        err = capsys.readouterr().err
        assert err.splitlines() == [
            f"error: {folder} is in use by the run on host {socket.gethostname()}, pid {first.pid}, started "
            f"{record['started']}; wait for it, stop it, or choose another job.dump_folder"]
        assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before  # nothing written
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert (folder / "checkpoint" / "step-3" / "COMPLETE").is_file()
    capsys.readouterr()
    assert main(run) == 0  # the relaunch loads the first run's checkpoint: it has nothing left to train
    captured = capsys.readouterr()
    assert "resumed from checkpoint" in captured.err and "nothing to train: step 3" in captured.out


def test_the_lock_of_a_killed_holder_is_free_at_once(tmp_path, capsys):
    """The kernel drops a flock with its holder's process, SIGKILL included: no stale lock to remove by hand."""
    folder = tmp_path / "run"
    code = f"from harness.run_lock import acquire_run_lock; lock = acquire_run_lock({str(folder)!r}, 0); input()"
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE)
    try:
        holder_of(folder, holder.pid)
        with pytest.raises(RunLockError, match=f"pid {holder.pid}"):
            acquire_run_lock(str(folder), 0)
    finally:
        holder.kill()
        holder.wait()
    assert main([*FAST, "--training.steps", "1", "--job.dump_folder", str(folder)]) == 0
    assert "done: 1 step" in capsys.readouterr().out


def test_a_launch_that_fails_after_locking_leaves_the_folder_free(tmp_path, capsys):
    """A start that fails once the trainer holds the lock (here: no checkpoint at checkpoint.load_step) frees it on
    the way out, also for a caller that launches again in the same process."""
    folder = tmp_path / "run"
    assert main([*FAST, "--checkpoint.enable", "true", "--checkpoint.load_step", "7",
                 "--job.dump_folder", str(folder)]) == BAD_INPUT
    assert "checkpoint.load_step = 7" in capsys.readouterr().err
    acquire_run_lock(str(folder), 0).release()


def test_the_lock_is_refused_while_held_in_this_process_too_and_free_once_released(tmp_path):
    """flock excludes two holders of one file even in one process (each open of the file is a holder)."""
    held = acquire_run_lock(str(tmp_path / "a"), 0)
    with pytest.raises(RunLockError, match=f"in use by the run on host .*, pid {os.getpid()}, started "):
        acquire_run_lock(str(tmp_path / "a"), 0)
    acquire_run_lock(str(tmp_path / "b"), 0).release()  # another folder: another lock
    held.release()
    held.release()  # idempotent
    acquire_run_lock(str(tmp_path / "a"), 0).release()


def test_a_folder_that_cannot_be_created_is_refused_in_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(RunLockError, match=r"cannot lock .*file/run/\.lock: .*; choose another job.dump_folder"):
        acquire_run_lock(str(tmp_path / "file" / "run"), 0)
