"""A checkpoint folder as a bad day leaves it: links planted in it, a step copied under another step's name, a step
the run may not read, a COMPLETE that vouches for nothing, a disk still full at the relaunch, a disk too small for the
checkpoints to come. Each is one line and a fallback, or one `error:` line and exit 2, and nothing outside the
checkpoint folder is ever touched (harness/checkpoint/checkpointer.py, integrity.py)."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from harness.checkpoint.integrity import COMPLETE, check_files, read_complete, write_complete
from harness.checkpoint.step_folders import ABANDONED, step_folders
from harness.config import DEFAULT_CONFIG
from harness.train import main
from tests.runs import losses

REPO = Path(__file__).resolve().parents[2]
CORPUS = str(REPO / "data" / "debug_corpus" / "train.jsonl")


@pytest.fixture(autouse=True)
def deterministic(deterministic_off_after):
    """Every run here is deterministic (the comparisons are bitwise)."""


def flags(dump: Path, cache: Path, *extra: str) -> list[str]:
    return ["--config", str(DEFAULT_CONFIG), "--training.dataset_path", CORPUS, "--training.dataset_cache_dir",
            str(cache), "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.deterministic",
            "true", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "true",
            "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0", "--job.dump_folder", str(dump), *extra]


def run(dump: Path, cache: Path, *extra: str) -> int:
    return main(flags(dump, cache, *extra))


def lines(text: str, start: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(start) or f"] {start}" in line]


def tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ---- links and copies ----

def test_pruning_and_rollback_never_act_through_a_linked_step(tmp_path, cache, capsys):
    """step-1 and step-9 planted as links to another run's complete checkpoints: the older is left alone by pruning
    (keep_latest_k 1), the newer fails verification and is set aside as a link; the other run's folder is intact."""
    elsewhere = tmp_path / "elsewhere"
    assert run(elsewhere, cache, "--training.steps", "2") == 0
    outside = tree(elsewhere / "checkpoint")
    dump = tmp_path / "run"
    assert run(dump, cache, "--training.steps", "2") == 0
    (dump / "checkpoint" / "step-1").symlink_to(elsewhere / "checkpoint" / "step-2")
    (dump / "checkpoint" / "step-9").symlink_to(elsewhere / "checkpoint" / "step-2")
    capsys.readouterr()
    assert run(dump, cache, "--training.steps", "6", "--checkpoint.keep_latest_k", "1") == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "step-9 failed verification: it is a symbolic link" in line]
    assert len(said) == 1 and "resuming from step-2" in said[0]
    assert tree(elsewhere / "checkpoint") == outside  # its COMPLETE too
    assert sorted(step_folders(dump / "checkpoint")) == [6]
    assert (dump / "checkpoint" / "step-1").is_symlink()  # not this run's to prune
    aside = list((dump / "checkpoint").glob(f"{ABANDONED}*/step-9"))
    assert len(aside) == 1 and aside[0].is_symlink()


def test_a_step_copied_under_a_newer_name_is_set_aside_and_the_run_equals_the_uninterrupted_one(
        tmp_path, cache, capsys):
    """step-2 copied to step-6: its COMPLETE says step 2, so it is set aside like a failed verification; with its
    COMPLETE edited to say 6, its train state still says 2, which verification reads too."""
    assert run(tmp_path / "ref", cache, "--training.steps", "6") == 0
    for edit_complete in (False, True):
        dump = tmp_path / f"edited-{edit_complete}"
        assert run(dump, cache, "--training.steps", "4") == 0
        shutil.copytree(dump / "checkpoint" / "step-2", dump / "checkpoint" / "step-6")
        if edit_complete:
            write_complete(dump / "checkpoint" / "step-6", {**read_complete(dump / "checkpoint" / "step-6"), "step": 6})
        capsys.readouterr()
        assert run(dump, cache, "--training.steps", "6") == 0
        err = capsys.readouterr().err
        why = "holds the state of step 2, not 6" if edit_complete else "its COMPLETE records step 2, not 6"
        said = [line for line in err.splitlines() if "step-6 failed verification" in line]
        assert len(said) == 1 and why in said[0] and "resuming from step-4" in said[0], err
        assert losses(dump) == losses(tmp_path / "ref")
        assert read_complete(dump / "checkpoint" / "step-6")["step"] == 6  # this run's own step 6 now
        assert len(list((dump / "checkpoint").glob(f"{ABANDONED}*/step-6"))) == 1



def test_folders_named_like_steps_but_not_steps_are_ignored_and_the_intact_step_is_resumed(tmp_path, cache, capsys):
    """Copies of step-2 named step-06, step-٦ (Arabic-Indic six), step-６ (full-width six) and "step-6\\n": int()
    reads each as 6, yet none is the folder step-6. They are named once, left as they are, and step-2 resumes; no
    empty abandoned-* is left behind."""
    assert run(tmp_path / "ref", cache, "--training.steps", "4") == 0
    dump = tmp_path / "run"
    assert run(dump, cache, "--training.steps", "2") == 0
    folder = dump / "checkpoint"
    odd = ["step-06", "step-\u0666", "step-\uff16", "step-6\n"]
    for name in odd:
        shutil.copytree(folder / "step-2", folder / name)
    before = {name: tree(folder / name) for name in odd}
    for _ in range(2):  # every relaunch, not only the first
        capsys.readouterr()
        assert run(dump, cache, "--training.steps", "4") == 0
        err = capsys.readouterr().err
        said = [line for line in err.splitlines() if "not named step-<step>" in line]
        assert len(said) == 1 and all(repr(name) in said[0] for name in odd), err
    assert losses(dump) == losses(tmp_path / "ref")
    assert {name: tree(folder / name) for name in odd} == before
    assert not list(folder.glob(f"{ABANDONED}*"))
    assert sorted(step_folders(folder)) == [2, 4]

# ---- COMPLETE that vouches for nothing ----

def test_a_complete_with_an_empty_file_map_fails_verification_and_the_previous_step_is_resumed(
        tmp_path, cache, capsys):
    """Before, an empty `files` map checked nothing: here step-4's weights are also damaged, which it hid."""
    assert run(tmp_path / "ref", cache, "--training.steps", "6") == 0
    dump = tmp_path / "run"
    assert run(dump, cache, "--training.steps", "4") == 0
    step_4 = dump / "checkpoint" / "step-4"
    write_complete(step_4, {**read_complete(step_4), "files": {}})
    with open(step_4 / "__0_0.distcp", "r+b") as f:  # bytes in the middle of the data: DCP reads them unchecked
        f.seek(os.path.getsize(step_4 / "__0_0.distcp") // 2)
        f.write(b"\xff" * 64)
    capsys.readouterr()
    assert run(dump, cache, "--training.steps", "6") == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "step-4 failed verification" in line]
    assert len(said) == 1 and "COMPLETE records no digest for __0_0.distcp" in said[0]
    assert losses(dump) == losses(tmp_path / "ref")


def test_a_complete_that_leaves_out_another_ranks_file_fails_that_ranks_check(tmp_path):
    folder = tmp_path / "step-2"
    folder.mkdir()
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata"):
        (folder / name).write_bytes(name.encode())
    record = {"step": 2, "files": {n: {"bytes": len(n), "sha256": __import__("hashlib").sha256(
        __import__("hashlib").sha256(n.encode()).digest()).hexdigest()} for n in ("__0_0.distcp", ".metadata")}}
    assert check_files(folder, record, rank=0, world=2) is None
    assert check_files(folder, record, rank=1, world=2) == f"{COMPLETE} records no digest for __1_0.distcp, which the " \
                                                          "folder holds"
    assert check_files(folder, record, rank=0, world=1).startswith(f"{COMPLETE} records no digest for __1_0.distcp")


# ---- a step the run may not read ----

_PR_CAPBSET_DROP, _CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 24, 1, 2


def _without_override_capabilities() -> None:
    """In the child before exec: root loses the capabilities that let it ignore file permissions (a non-root user
    has none to lose)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)


def test_an_unreadable_newest_step_fails_verification_and_the_previous_one_is_resumed(tmp_path, cache):
    """chmod 000 on the newest step, the relaunch run by a process that file permissions bind (a subprocess)."""
    dump = tmp_path / "run"
    assert run(dump, cache, "--training.steps", "4") == 0
    step_4 = dump / "checkpoint" / "step-4"
    step_4.chmod(0)
    try:
        probe = subprocess.run([sys.executable, "-c", f"import os; os.listdir({str(step_4)!r})"],
                               preexec_fn=_without_override_capabilities, capture_output=True)
        if probe.returncode == 0:
            pytest.skip("this process cannot give up reading every file (root without CAP_SETPCAP)")
        done = subprocess.run([sys.executable, "-m", "harness.train", *flags(dump, cache, "--training.steps", "6")],
                              preexec_fn=_without_override_capabilities, capture_output=True, text=True, cwd=REPO,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        for path in [*dump.rglob(f"{ABANDONED}*step-4"), step_4]:
            if os.path.lexists(path):
                path.chmod(0o755)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "step-4 failed verification" in line]
    assert len(said) == 1 and "Permission denied" in said[0] and "resuming from step-2" in said[0]
    assert "Traceback" not in done.stderr
    assert sorted(step_folders(dump / "checkpoint")) == [2, 4, 6]  # step-4 is the resumed line's own now
    assert len(list((dump / "checkpoint").glob(f"{ABANDONED}*step-4"))) == 1  # the unreadable one, kept


# ---- the disk ----

def test_a_relaunch_while_the_disk_is_still_full_is_one_line(tmp_path, cache, capsys, monkeypatch):
    """The resume rewrites metrics.jsonl up to its step: ENOSPC there (before, a traceback from metrics.py)."""
    import harness.metrics

    dump = tmp_path / "run"
    assert run(dump, cache, "--training.steps", "3") == 0
    shutil.rmtree(dump / "checkpoint" / "step-3")  # as a kill before that save: the resume drops step 3's line
    before = (dump / "metrics.jsonl").read_bytes()

    def full(path, text, durable=False):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(harness.metrics, "write_whole", full)
    capsys.readouterr()
    assert run(dump, cache, "--training.steps", "4") == 2
    err = capsys.readouterr().err
    assert len(lines(err, "error:")) == 1 and "Traceback" not in err
    assert lines(err, "error:")[0].startswith(f"error: cannot write {dump / 'metrics.jsonl'}: No space left on device")
    assert (dump / "metrics.jsonl").read_bytes() == before


Usage = namedtuple("Usage", "total used free")


@pytest.mark.parametrize("room, code", [(2.5, 0), (0.5, 2)])
def test_the_start_says_when_the_checkpoints_to_come_do_not_fit(tmp_path, cache, capsys, monkeypatch, room, code):
    """keep_latest_k 2: three checkpoints at once. Room for 2.5 of them: one warning line at the start, and the
    run goes on; room for half of one: exit 2 before the first step."""
    import harness.checkpoint.checkpointer as checkpointer

    size = {}
    state_bytes = checkpointer.Checkpointer.state_bytes
    monkeypatch.setattr(checkpointer.Checkpointer, "state_bytes",
                        lambda self: size.setdefault("bytes", state_bytes(self)))
    real = shutil.disk_usage
    monkeypatch.setattr(checkpointer.shutil, "disk_usage", lambda path: Usage(1 << 40, 0, int(room * size["bytes"]))
                        if "checkpoint" in str(path) else real(path))
    capsys.readouterr()
    assert run(tmp_path, cache, "--training.steps", "6", "--checkpoint.keep_latest_k", "2") == code
    err = capsys.readouterr().err
    if code == 0:
        said = [line for line in err.splitlines() if "one checkpoint takes about" in line]
        assert len(said) == 1 and "the 3 this run holds at once" in said[0] and "do not fit" in said[0]
    else:
        assert len(lines(err, "error:")) == 1 and "not even one checkpoint fits" in err and "Traceback" not in err
        assert not (tmp_path / "metrics.jsonl").exists() or (tmp_path / "metrics.jsonl").read_text() == ""


def test_the_estimate_of_a_checkpoints_size_is_within_5_percent_of_the_saved_files(tmp_path, cache):
    """What the start-up check compares with the free space: the model, the AdamW moments and DCP's per-tensor
    records (measured 3% under the files, the rest DCP's metadata and the small states)."""
    from harness.config import load_config
    from harness.trainer import Trainer

    trainer = Trainer(load_config(flags(tmp_path, cache, "--training.steps", "1")))
    try:
        estimate = trainer.checkpointer.state_bytes()
        trainer.train()
    finally:
        trainer.close()
    step = tmp_path / "checkpoint" / "step-1"
    saved = sum(p.stat().st_size for p in step.iterdir() if p.suffix == ".distcp" or p.name == ".metadata")
    assert 0.95 * saved < estimate <= saved


class _Rows:
    def state_dict(self) -> dict:
        return {"next_row": 0}


def test_a_full_disk_met_through_a_process_group_is_one_checkpoint_error(tmp_path, monkeypatch):
    """Under a process group (every GPU run has one, one GPU too) DCP passes each rank's failure to all through a
    pickle, which drops the OSError behind torch's writer's RuntimeError ("unexpected pos"): seen on an H200 as a
    traceback and exit 1 where one process on CPU gave the one line. A group of one gloo rank shows it on CPU."""
    import torch.distributed as dist
    from torch import nn

    import harness.checkpoint.checkpointer as checkpointer
    from tests.checkpoint_faults import disk_fills_during_dcp_writes

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = nn.Linear(256, 256)
        optimizer = torch.optim.AdamW(model.parameters())
        saver = checkpointer.Checkpointer(tmp_path / "checkpoint", model, optimizer,
                                          torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1), _Rows(),
                                          keep_latest_k=2, async_mode="disabled", model_config={})
        disk_fills_during_dcp_writes(monkeypatch, under="step-1", room=50_000)  # inside a tensor
        monkeypatch.setattr(checkpointer.shutil, "disk_usage", lambda path: Usage(1 << 30, 1 << 30, 0))  # full
        with pytest.raises(checkpointer.CheckpointError, match=r"cannot save checkpoint step-1 to .*: No space left "
                                                               r"on device \(torch's writer: unexpected pos"):
            saver.save(1)
    finally:
        dist.destroy_process_group()
