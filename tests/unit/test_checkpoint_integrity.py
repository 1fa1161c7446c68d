"""Nothing lost, nothing silent: checkpoints under the faults they meet in the field, on one process (the trainer
in-process, as run_train.sh runs it; a subprocess where the fault is a SIGKILL). Each run is compared with an
independent reference: the uninterrupted run, or what the files held before the fault.
(Two ranks agreeing on a failed verification: tests/distributed/test_resume.py.)"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.checkpoint.checkpointer import Checkpointer
from harness.checkpoint.integrity import COMPLETE, check_files, file_digest, read_complete
from harness.checkpoint.step_folders import ABANDONED, step_folders
from harness.config import load_config
from harness.convert import main as convert_main
from harness.train import main
from tests.checkpoint_faults import (
    disk_fills_during_dcp_writes,
    disk_fills_during_hf_writes,
    flip_tensor_bytes,
)
from tests.runs import losses

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "train_configs" / "debug_model.toml")
CORPUS = str(REPO / "data" / "debug_corpus" / "train.jsonl")
EMBEDDING, ITS_ADAM_STATE = "model.embed_tokens.weight", "optimizer.state.embed_tokens.weight.exp_avg_sq"


@pytest.fixture(autouse=True)
def deterministic(deterministic_off_after):
    """Every run here is deterministic (the comparisons are bitwise)."""


def flags(dump: Path, cache: Path, *extra: str) -> list[str]:
    return ["--config", CONFIG, "--training.dataset_path", CORPUS, "--training.dataset_cache_dir", str(cache),
            "--training.seq_len", "64", "--training.local_batch_size", "4", "--training.deterministic", "true",
            "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "true",
            "--checkpoint.keep_latest_k", "0", "--job.dump_folder", str(dump), *extra]


def run(dump: Path, cache: Path, *extra: str) -> int:
    return main(flags(dump, cache, *extra))


def errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def verifies(step_dir: Path) -> bool:
    return check_files(step_dir, read_complete(step_dir)) is None


def abandoned(dump: Path) -> list[Path]:
    return sorted((dump / "checkpoint").glob(f"{ABANDONED}*/step-*"))


# ---- the digest ----

@pytest.mark.parametrize("size", [0, 1, 4096, 4097, 4096 * 3 + 1000])
@pytest.mark.parametrize("threads", [1, 3])
def test_a_file_digest_is_the_sha256_of_its_chunks_sha256(tmp_path, size, threads):
    data = random.Random(size).randbytes(size)
    path = tmp_path / "file"
    path.write_bytes(data)
    chunks = [data[i:i + 4096] for i in range(0, size, 4096)] or [b""]
    expected = hashlib.sha256(b"".join(hashlib.sha256(c).digest() for c in chunks)).hexdigest()
    assert file_digest(path, threads, chunk_bytes=4096) == {"bytes": size, "sha256": expected}


def test_complete_records_the_digest_of_every_file_of_the_checkpoint(tmp_path, cache):
    assert run(tmp_path, cache, "--training.steps", "1") == 0
    step = tmp_path / "checkpoint" / "step-1"
    record = read_complete(step)
    on_disk = {str(p.relative_to(step)) for p in step.rglob("*") if p.is_file()} - {COMPLETE}
    assert record["files"].keys() == on_disk and on_disk >= {".metadata", "__0_0.distcp", "hf/config.json"}
    for name, digest in record["files"].items():
        assert digest == file_digest(step / name), name


# ---- bytes flipped: fall back to the newest checkpoint that verifies ----

@pytest.mark.parametrize("key", [EMBEDDING, ITS_ADAM_STATE])
def test_flipped_bytes_in_the_latest_checkpoint_resume_the_previous_one_and_the_run_equals_the_uninterrupted_one(
        tmp_path, cache, capsys, key):
    assert run(tmp_path, cache, "--training.steps", "4", "--checkpoint.interval", "1") == 0
    uninterrupted = losses(tmp_path)
    shutil.rmtree(tmp_path / "checkpoint" / "step-4")  # the job died after step 3's save...
    corrupt = flip_tensor_bytes(tmp_path / "checkpoint" / "step-3", key)  # ...and the disk flipped 64 bytes of it
    capsys.readouterr()
    # keep_latest_k 1: the corrupt step-3 must not be taken for the newest and push the good ones out.
    assert run(tmp_path, cache, "--training.steps", "4", "--checkpoint.interval", "1",
               "--checkpoint.keep_latest_k", "1") == 0
    err = capsys.readouterr().err
    failed = [line for line in err.splitlines() if "failed verification" in line]
    assert len(failed) == 1 and f"checkpoint step-3 failed verification: {corrupt.name} digest" in failed[0]
    assert failed[0].endswith("resuming from step-2"), failed[0]
    assert "resumed from checkpoint" in err and "step-2 (step 2)" in err
    assert losses(tmp_path) == uninterrupted  # steps 3 and 4 trained again, from step 2: the same bits
    assert sorted(step_folders(tmp_path / "checkpoint")) == [4] and verifies(tmp_path / "checkpoint" / "step-4")
    assert [p.name for p in abandoned(tmp_path)] == ["step-3"]  # moved aside, kept, never pruned


def test_when_no_checkpoint_verifies_the_run_stops_with_one_line_and_moves_nothing(tmp_path, cache, capsys):
    assert run(tmp_path, cache, "--training.steps", "2", "--checkpoint.interval", "1") == 0
    for step in (1, 2):
        flip_tensor_bytes(tmp_path / "checkpoint" / f"step-{step}", EMBEDDING)
    before = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    capsys.readouterr()
    assert run(tmp_path, cache, "--training.steps", "3") == 2
    err = capsys.readouterr().err
    assert len(errors(err)) == 1 and "Traceback" not in err
    assert errors(err)[0].startswith("error: checkpoint step-2 failed verification: __0_0.distcp digest")
    assert "checkpoint step-1 failed verification" in errors(err)[0] and "no checkpoint in" in errors(err)[0]
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == before


def test_a_checkpoint_saved_before_checksums_resumes_with_a_warning_and_no_run_config(
        tmp_path, cache, capsys, monkeypatch):
    """As the trainer saved it before COMPLETE held digests and the train state the run's config; a checkpoint saved
    now gives back the saving run's config."""
    train_state = Checkpointer._train_state
    with monkeypatch.context() as earlier:
        earlier.setattr(Checkpointer, "_train_state", lambda self, step, run_id: {
            k: v for k, v in train_state(self, step, run_id).items() if k != "run_config"})
        assert run(tmp_path, cache, "--training.steps", "3", "--checkpoint.interval", "1") == 0
    uninterrupted = losses(tmp_path)
    shutil.rmtree(tmp_path / "checkpoint" / "step-3")
    (tmp_path / "checkpoint" / "step-2" / COMPLETE).write_text(json.dumps({"step": 2, "world_size": 1}) + "\n")
    capsys.readouterr()
    assert run(tmp_path, cache, "--training.steps", "3", "--checkpoint.interval", "1") == 0
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if "has no checksums" in line and "unverified" in line]) == 1
    assert losses(tmp_path) == uninterrupted

    from harness.trainer import Trainer

    trainer = Trainer(load_config(flags(tmp_path, cache, "--training.steps", "4")))
    assert trainer.checkpointer.resume(2)["run_config"] is None  # the earlier train state has none
    assert trainer.checkpointer.resume(3)["run_config"] == load_config(
        flags(tmp_path, cache, "--training.steps", "3", "--checkpoint.interval", "1")).to_dict()  # the saving run's
    trainer.close()


# ---- rollback ----

def test_load_step_rolls_back_and_a_plain_relaunch_continues_the_rolled_back_line(tmp_path, cache, capsys):
    """Before: a relaunch after `load_step` resumed the abandoned newer step, and keep_latest_k 1 pruned the new one
    the moment it was written. Here the rolled-back line trains with other settings (gradients clipped at 0.05), so
    the two lines differ; the LR is constant, so that training.steps 3 can stand for a kill after step 3's save."""
    constant_lr = ["--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0"]
    assert run(tmp_path / "a", cache, *constant_lr, "--training.steps", "4", "--checkpoint.interval", "2") == 0
    # The reference: step 2 resumed with the new settings, nothing newer in the folder.
    new_line = [*constant_lr, "--training.max_norm", "0.05", "--checkpoint.interval", "1",
                "--checkpoint.keep_latest_k", "1"]
    for name in ("reference", "rolled_back"):
        shutil.copytree(tmp_path / "a", tmp_path / name)
    shutil.rmtree(tmp_path / "reference" / "checkpoint" / "step-4")
    assert run(tmp_path / "reference", cache, *new_line, "--training.steps", "4") == 0
    assert losses(tmp_path / "reference")[4] != losses(tmp_path / "a")[4]

    folder = tmp_path / "rolled_back"
    abandoned_step = (folder / "checkpoint" / "step-4" / "__0_0.distcp").read_bytes()
    capsys.readouterr()
    assert run(folder, cache, *new_line, "--training.steps", "3", "--checkpoint.load_step", "2") == 0
    moved = [line for line in capsys.readouterr().err.splitlines() if "aside to" in line]
    assert len(moved) == 1 and "moved step-4 aside" in moved[0] and "rolls back to step-2" in moved[0]
    assert sorted(step_folders(folder / "checkpoint")) == [3]  # the step just saved stays
    assert run(folder, cache, *new_line, "--training.steps", "4") == 0  # a plain relaunch
    err = capsys.readouterr().err
    assert "step-3 (step 3)" in err
    kept = [line for line in err.splitlines() if "set aside earlier" in line]  # reported, not deleted
    assert len(kept) == 1 and f"1 folder(s) of checkpoints set aside earlier are kept in {folder / 'checkpoint'}" \
        in kept[0] and "abandoned-" in kept[0], err
    assert losses(folder) == losses(tmp_path / "reference")
    assert sorted(step_folders(folder / "checkpoint")) == [4]
    [aside] = abandoned(folder)
    assert aside.name == "step-4" and (aside / COMPLETE).is_file()
    assert (aside / "__0_0.distcp").read_bytes() == abandoned_step


# ---- pruning ----

def test_pruning_never_deletes_the_checkpoint_just_saved_and_removes_complete_before_the_files(tmp_path, monkeypatch):
    import harness.checkpoint.checkpointer as checkpointer

    for step in (2, 3, 9):  # step-9: a complete folder copied in with a higher number
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / "__0_0.distcp").write_bytes(b"x")
        (tmp_path / f"step-{step}" / COMPLETE).write_text("{}")
    (tmp_path / f"{ABANDONED}20260101T000000Z" / "step-1").mkdir(parents=True)
    complete_when_deleted = {}
    rmtree = shutil.rmtree
    monkeypatch.setattr(checkpointer.shutil, "rmtree", lambda path, **kw: (
        complete_when_deleted.setdefault(Path(path).name, (Path(path) / COMPLETE).exists()), rmtree(path, **kw)))
    pruner = Checkpointer.__new__(Checkpointer)
    pruner.folder, pruner.keep_latest_k = tmp_path, 1
    pruner._prune(keep=3)
    assert sorted(step_folders(tmp_path)) == [3, 9]
    assert complete_when_deleted == {"step-2": False}  # COMPLETE went first: a kill there leaves no complete partial
    assert (tmp_path / f"{ABANDONED}20260101T000000Z" / "step-1").is_dir()  # pruning looks at step-N folders only


# ---- a full disk ----

@pytest.mark.parametrize("where", ["data file", "COMPLETE"])
def test_a_full_disk_during_a_save_stops_with_one_line_and_keeps_the_earlier_checkpoint(
        tmp_path, cache, capsys, monkeypatch, where):
    import harness.checkpoint.checkpointer as checkpointer

    assert run(tmp_path / "ref", cache, "--training.steps", "4", "--checkpoint.interval", "2") == 0
    with monkeypatch.context() as patched:
        if where == "data file":
            disk_fills_during_dcp_writes(patched, under="step-4")
        else:
            write_complete = checkpointer.write_complete

            def full_at_step_4(path, record):
                if path.name == "step-4":
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path / f"{COMPLETE}.tmp"))
                write_complete(path, record)

            patched.setattr(checkpointer, "write_complete", full_at_step_4)
        capsys.readouterr()
        assert run(tmp_path / "run", cache, "--training.steps", "4", "--checkpoint.interval", "2") == 2
    err = capsys.readouterr().err
    folder = tmp_path / "run" / "checkpoint"
    assert len(errors(err)) == 1 and "Traceback" not in err
    line = errors(err)[0]
    assert line.startswith(f"error: cannot save checkpoint step-4 to {folder / 'step-4'}: [Errno 28] No space left")
    assert f"the last intact checkpoint is step-2 ({folder / 'step-2'})" in line
    assert sorted(step_folders(folder)) == [2] and verifies(folder / "step-2")
    assert (folder / "step-4").is_dir() and not (folder / "step-4" / COMPLETE).exists()  # partial: never resumed
    # Space again: the relaunch resumes step 2 and rewrites step 4; the run is the uninterrupted one.
    assert run(tmp_path / "run", cache, "--training.steps", "4", "--checkpoint.interval", "2") == 0
    assert losses(tmp_path / "run") == losses(tmp_path / "ref")
    assert sorted(step_folders(folder)) == [2, 4] and verifies(folder / "step-4")


def test_a_full_disk_during_the_hf_export_stops_with_one_line_and_leaves_the_earlier_export(
        tmp_path, cache, capsys, monkeypatch):
    """The relaunch continues the line (it resumes step 1), so its export would replace the earlier one in place."""
    export = ["--checkpoint.export_hf_at_end", "true", "--checkpoint.interval", "1"]
    assert run(tmp_path, cache, *export, "--training.steps", "1") == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    disk_fills_during_hf_writes(monkeypatch)
    capsys.readouterr()
    assert run(tmp_path, cache, *export, "--training.steps", "2") == 2  # other weights, were they written
    err = capsys.readouterr().err
    assert len(errors(err)) == 1 and "Traceback" not in err
    assert errors(err)[0].startswith(f"error: cannot write the Hugging Face folder {tmp_path / 'hf'}: ")
    assert "No space left on device" in errors(err)[0] and "nothing was replaced" in errors(err)[0]
    step_2 = tmp_path / "checkpoint" / "step-2"  # what is on disk, and how to export it once there is space
    assert errors(err)[0].endswith(f"the last complete checkpoint is step-2 ({step_2}), which a relaunch resumes; "
                                   f"python -m harness.convert {step_2} <folder> exports it")
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == before
    assert not (tmp_path / "hf.tmp").exists()


# ---- the converter ----

def test_the_converter_refuses_an_incomplete_or_corrupt_step_and_a_full_disk_leaves_no_output(
        tmp_path, cache, capsys, monkeypatch):
    assert run(tmp_path, cache, "--training.steps", "2", "--checkpoint.interval", "1") == 0
    steps = tmp_path / "checkpoint"
    (steps / "step-2" / COMPLETE).unlink()  # as a save killed before its end leaves it
    flip_tensor_bytes(steps / "step-1", EMBEDDING)
    capsys.readouterr()
    for step, says in ((2, "has no COMPLETE: its save never finished"),
                       (1, "failed verification: __0_0.distcp digest")):
        assert convert_main([str(steps / f"step-{step}"), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith(f"error: {'checkpoint ' if step == 1 else ''}"
                                                             f"{steps / f'step-{step}'}") and says in err, err
        assert not (tmp_path / "out").exists()

    assert run(tmp_path / "good", cache, "--training.steps", "1") == 0
    disk_fills_during_hf_writes(monkeypatch)
    capsys.readouterr()
    assert convert_main([str(tmp_path / "good" / "checkpoint" / "step-1"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "No space left on device" in err and str(tmp_path / "out") in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()


def test_the_converter_converts_a_step_without_checksums_with_a_warning(tmp_path, cache, capsys):
    assert run(tmp_path, cache, "--training.steps", "1", "--checkpoint.export_hf_at_end", "true") == 0
    (tmp_path / "checkpoint" / "step-1" / COMPLETE).write_text(json.dumps({"step": 1, "world_size": 1}) + "\n")
    capsys.readouterr()
    assert convert_main([str(tmp_path / "checkpoint" / "step-1"), str(tmp_path / "out")]) == 0
    assert "warning:" in capsys.readouterr().err
    for exported in (tmp_path / "hf").glob("*.safetensors"):
        assert (tmp_path / "out" / exported.name).read_bytes() == exported.read_bytes()


# ---- what is unpickled ----

class _Touches:
    """Unpickling it would create a file: what a checkpoint from someone else could do."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def test_a_train_state_holding_objects_is_refused_not_unpickled(tmp_path, cache, capsys, monkeypatch):
    """The train state is read with weights_only=True (the trainer's own states load so: every other test here)."""
    marker = tmp_path / "code-ran"
    train_state = Checkpointer._train_state
    monkeypatch.setattr(Checkpointer, "_train_state",
                        lambda self, step, run_id: {**train_state(self, step, run_id), "extra": _Touches(marker)})
    assert run(tmp_path, cache, "--training.steps", "1") == 0
    monkeypatch.undo()
    capsys.readouterr()
    assert run(tmp_path, cache, "--training.steps", "2") == 2
    err = capsys.readouterr().err
    assert len(errors(err)) == 1 and "holds more than tensors and plain values" in errors(err)[0]
    assert not marker.exists()


# ---- SIGKILL in the middle of a save ----

def test_sigkill_at_random_moments_of_a_save_then_a_relaunch_equals_the_uninterrupted_run(tmp_path, cache):
    """Killed during its step-4 save (before its files, among them, after COMPLETE while pruning step-2...): what
    is left complete verifies, and the relaunch resumes the newest complete step and ends as the uninterrupted run."""
    six = ["--training.steps", "6", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "1"]
    assert run(tmp_path / "ref", cache, *six) == 0
    fractions = [random.uniform(0.0, 1.3) for _ in range(3)]  # of the first save's time, from the second's start
    killed = [subprocess.Popen([sys.executable, "-m", "tests.checkpoint_faults", str(f),
                                *flags(tmp_path / f"killed{i}", cache, *six)], cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
              for i, f in enumerate(fractions)]  # side by side: each starts torch in its own process
    for i, (proc, fraction) in enumerate(zip(killed, fractions)):
        _, err = proc.communicate(timeout=300)
        at = f"killed at {fraction:.2f} of a save"
        assert proc.returncode == -9, f"{at}: {err[-3000:]}"
        folder = tmp_path / f"killed{i}"
        left = step_folders(folder / "checkpoint")
        assert set(left) in ({2}, {2, 4}, {4}) and all(map(verifies, left.values())), at
        assert run(folder, cache, *six) == 0, at
        assert losses(folder) == losses(tmp_path / "ref"), at
        complete = step_folders(folder / "checkpoint")
        assert sorted(complete) == [6] and verifies(complete[6]), at
