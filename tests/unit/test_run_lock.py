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
from types import SimpleNamespace

import pytest

from harness import run_lock
from harness.run_lock import LOCK_FILE, RunLockError, acquire_run_lock
from harness.train import BAD_INPUT, main

REPO = Path(__file__).resolve().parents[2]
FAST = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false",
        "--checkpoint.export_hf_at_end", "false"]


def holder_of(folder: Path, pid: int, timeout: float = 600) -> dict:
    """The lock record of `folder` once process `pid` has written it (the timeout guards a hang only)."""
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


def test_a_second_launch_into_a_held_folder_exits_2_naming_the_holder_and_the_first_run_finishes(
        tmp_path, capsys, monkeypatch):
    """Two launches on one dump folder: the first (run_train.sh, held still with SIGSTOP once it has the lock, so the
    second surely meets it) keeps it; the second exits 2 at once, reading the holder's record without waiting for it,
    with one line naming host, pid and start time, having written nothing; the first then finishes and its checkpoint
    loads."""
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
        waits = []  # the refused launch's pauses to read the record again (run_lock._holder)
        with monkeypatch.context() as patch:
            patch.setattr(run_lock, "time", SimpleNamespace(monotonic=time.monotonic, strftime=time.strftime,
                                                            sleep=lambda seconds: waits.append(seconds)))
            assert main(run) == BAD_INPUT
        assert waits == []  # a running holder's record is read at once
        err = capsys.readouterr().err
        assert err.splitlines() == [
            f"error: {folder} is in use by the run on host {socket.gethostname()}, pid {first.pid}, started "
            f"{record['started']}; wait for it, stop it, or choose another job.dump_folder"]
        assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == before  # nothing written
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out, err = first.communicate(timeout=900)
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


def test_two_runs_with_one_absolute_checkpoint_folder_are_refused_naming_the_setting(tmp_path, capsys):
    """Different dump folders, one absolute checkpoint.folder: the second launch meets the first's lock there, and
    writes nothing into it (before, both saved steps there and one resumed the other's weights)."""
    shared = tmp_path / "shared_checkpoints"
    from harness.config import DEFAULT_CONFIG, load_config
    from harness.run_folders import written_folders

    first = load_config(["--config", str(DEFAULT_CONFIG), "--job.dump_folder", str(tmp_path / "a"),
                         "--checkpoint.enable", "true", "--checkpoint.folder", str(shared)])
    held = acquire_run_lock(written_folders(first), 0)
    try:
        before = sorted(shared.rglob("*"))
        capsys.readouterr()
        assert main([*FAST, "--training.steps", "1", "--job.dump_folder", str(tmp_path / "b"),
                     "--checkpoint.enable", "true", "--checkpoint.folder", str(shared)]) == BAD_INPUT
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith(f"error: {shared} is in use by the run on host ")
        assert err.rstrip().endswith("choose another checkpoint.folder")
        assert sorted(shared.rglob("*")) == before
    finally:
        held.release()


def test_a_lock_file_planted_as_a_link_or_a_hard_link_is_refused_and_its_target_never_written(tmp_path, capsys):
    victim = tmp_path / "victims_file"
    victim.write_text("the user's own data\n")
    for plant in (os.symlink, os.link):
        folder = tmp_path / plant.__name__
        folder.mkdir()
        plant(victim, folder / LOCK_FILE)
        capsys.readouterr()
        assert main([*FAST, "--training.steps", "1", "--job.dump_folder", str(folder)]) == BAD_INPUT
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith(f"error: cannot lock {folder / LOCK_FILE}: it is ")
        assert victim.read_text() == "the user's own data\n"


def test_a_temporary_file_name_planted_as_a_link_is_never_written_through(tmp_path):
    """The resolved config is written through a temporary file beside config.toml: a link planted at the name an
    earlier version used (tmp.config.toml) is left alone, as is its target; config.toml is a file of its own."""
    victim = tmp_path / "victims_file"
    victim.write_text("the user's own data\n")
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "tmp.config.toml").symlink_to(victim)
    assert main([*FAST, "--training.steps", "1", "--job.dump_folder", str(folder)]) == 0
    assert victim.read_text() == "the user's own data\n"
    assert (folder / "config.toml").is_file() and not (folder / "config.toml").is_symlink()
    assert "[training]" in (folder / "config.toml").read_text()
