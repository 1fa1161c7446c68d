"""Where a run writes never overlaps what it replaces or another run's folders (harness/run_folders.py, run_lock.py):
a checkpoint folder among the run's own outputs or in another run's dump folder, a dump folder inside another run's
export, and any folder inside or holding a running run's are refused at start, with one line, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.run_lock import acquire_run_lock
from harness.train import BAD_INPUT, main
from tests.unit.test_convert_output_folder import one_error

FAST = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false",
        "--training.steps", "1"]


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


@pytest.mark.parametrize("folder", ["hf", "hf-adapter", "metrics.jsonl", "tb", "tb/ck", "hf/checkpoints", ".", "..",
                                    "dataset_cache", "hf.tmp", "hf-20261201-101010-ab12", "config-x.toml"])
def test_a_checkpoint_folder_among_the_runs_own_outputs_is_refused_before_anything_is_written(
        tmp_path, capsys, folder):
    """Before, `hf`, `hf-adapter`, `metrics.jsonl` or `tb` had a fresh launch set the run's own checkpoints aside as
    another run's outputs, and an export replaced them whole."""
    dump = tmp_path / "run"
    assert main([*FAST, "--job.dump_folder", str(dump), "--metrics.enable_tensorboard", "true",
                 "--checkpoint.enable", "true", "--checkpoint.folder", folder]) == BAD_INPUT
    line = one_error(capsys, logged=True)
    assert f"checkpoint.folder {folder!r}" in line and "name a folder of its own" in line, line
    assert not dump.exists()


def test_a_checkpoint_folder_in_holding_or_being_another_runs_dump_folder_is_refused(tmp_path, capsys):
    other = tmp_path / "runs" / "other"
    assert main([*FAST, "--job.dump_folder", str(other)]) == 0
    assert (other / "run.json").is_file()
    before = tree(tmp_path / "runs")
    for checkpoint, what in ((other, "is"), (other / "checkpoint", "lies inside"), (tmp_path / "runs", "holds")):
        capsys.readouterr()
        assert main([*FAST, "--job.dump_folder", str(tmp_path / "mine"), "--checkpoint.enable", "true",
                     "--checkpoint.folder", str(checkpoint)]) == BAD_INPUT
        line = one_error(capsys, logged=True)
        assert f"{what} {other}, another run's dump folder" in line or f"{what} {other}," in line, line
    assert tree(tmp_path / "runs") == before and not (tmp_path / "mine").exists()


def test_a_dump_folder_inside_another_runs_export_is_refused(tmp_path, capsys):
    """`--job.dump_folder RUN/hf`: the run would fill RUN's export folder, which RUN's next export replaces whole."""
    run = tmp_path / "run"
    assert main([*FAST, "--job.dump_folder", str(run), "--checkpoint.export_hf_at_end", "true"]) == 0
    export = {p.name: p.read_bytes() for p in (run / "hf").iterdir()}
    capsys.readouterr()
    assert main([*FAST, "--job.dump_folder", str(run / "hf" / "sub")]) == BAD_INPUT
    assert f"lies inside {run / 'hf'}, an output of the run whose dump folder is {run}" in one_error(capsys, logged=True)
    assert {p.name: p.read_bytes() for p in (run / "hf").iterdir()} == export


def test_a_folder_inside_or_holding_a_running_runs_folder_is_refused_naming_it(tmp_path, capsys):
    """A run's lock covers what lies under its dump folder: a launch into RUN/sub while RUN trains (before: accepted,
    and RUN's export at the end refused, nothing saved), and a launch into RUN's parent, are refused naming RUN's
    holder; nothing is created inside RUN."""
    run = tmp_path / "parent" / "run"
    held = acquire_run_lock(str(run), 0)  # as a running run holds it: another open file of the lock
    try:
        holder = json.loads((run / ".lock").read_text())
        capsys.readouterr()
        assert main([*FAST, "--job.dump_folder", str(run / "sub")]) == BAD_INPUT
        line = one_error(capsys, logged=True)
        assert f"lies inside {run}, which is in use by the run on host {holder['host']}, pid {holder['pid']}" in line
        assert line.endswith("choose another job.dump_folder") and tree(run) == [".lock"]
        assert main([*FAST, "--job.dump_folder", str(tmp_path / "parent")]) == BAD_INPUT
        line = one_error(capsys, logged=True)
        assert f"{tmp_path / 'parent'} holds {run}, which is in use by the run on host" in line, line
        assert main([*FAST, "--job.dump_folder", str(tmp_path / "mine"), "--checkpoint.enable", "true",
                     "--checkpoint.folder", str(run / "ck")]) == BAD_INPUT
        assert "choose another checkpoint.folder" in one_error(capsys, logged=True) and tree(run) == [".lock"]
    finally:
        held.release()
    assert main([*FAST, "--job.dump_folder", str(run / "sub")]) == 0  # free once RUN has ended
