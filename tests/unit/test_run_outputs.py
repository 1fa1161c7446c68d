"""A dump folder's metrics.jsonl, config.toml and hf/ belong to one line of training (harness/run_outputs.py): a fresh
relaunch sets another run's aside instead of emptying or replacing them, and a resume continues exactly the records
of its own line, even after another run has used the folder in between."""

from __future__ import annotations

import json
from pathlib import Path

from harness.train import main

FAST = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false",
        "--checkpoint.export_hf_at_end", "false", "--metrics.log_freq", "1"]


def run(folder: Path, *flags: str) -> int:
    return main([*FAST, "--job.dump_folder", str(folder), *flags])


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_id(folder: Path) -> str:
    return json.loads((folder / "run.json").read_text())["run"]


def test_a_fresh_relaunch_keeps_the_earlier_runs_records_aside_and_says_so(tmp_path, capsys):
    assert run(tmp_path, "--training.steps", "5") == 0
    first, first_id = records(tmp_path / "metrics.jsonl"), run_id(tmp_path)
    first_config = (tmp_path / "config.toml").read_text()
    capsys.readouterr()
    assert run(tmp_path, "--training.steps", "2", "--optimizer.lr", "1e-4") == 0
    err = capsys.readouterr().err
    assert [r["step"] for r in records(tmp_path / "metrics.jsonl")] == [1, 2]  # this run's line alone
    assert records(tmp_path / f"metrics-{first_id}.jsonl") == first  # the earlier run's, whole
    assert (tmp_path / f"config-{first_id}.toml").read_text() == first_config
    said = [line for line in err.splitlines() if f"held the outputs of the run {first_id}" in line]
    assert len(said) == 1 and f"metrics-{first_id}.jsonl" in said[0] and f"config-{first_id}.toml" in said[0]
    assert run_id(tmp_path) != first_id


def test_a_resume_after_another_run_used_the_folder_continues_exactly_its_own_records(tmp_path):
    """A checkpointed run, an uncheckpointed relaunch into the same folder, then a resume of the first: the file
    holds the first run's steps 1-5 as it logged them, then 6-7; the relaunch's step is kept aside."""
    saved = ["--checkpoint.enable", "true", "--checkpoint.interval", "5"]
    assert run(tmp_path, *saved, "--training.steps", "5") == 0
    first, first_id = records(tmp_path / "metrics.jsonl"), run_id(tmp_path)
    assert run(tmp_path, "--training.steps", "1", "--training.seed", "3") == 0
    other_id = run_id(tmp_path)
    assert run(tmp_path, *saved, "--training.steps", "7") == 0
    resumed = records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6, 7] and resumed[:5] == first
    assert run_id(tmp_path) == first_id
    assert [r["step"] for r in records(tmp_path / f"metrics-{other_id}.jsonl")] == [1]
    assert not (tmp_path / f"metrics-{first_id}.jsonl").exists()  # brought back, not copied


def test_the_mtp_example_after_the_quick_start_keeps_the_quick_starts_export(tmp_path, capsys):
    """README's quick start, then its MTP example, both writing one dump folder with an export at the end."""
    export = ["--checkpoint.export_hf_at_end", "true", "--training.steps", "1"]
    assert run(tmp_path, *export) == 0
    first_id = run_id(tmp_path)
    exported = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    capsys.readouterr()
    assert run(tmp_path, *export, "--model.flavor", "debugmodel_mtp") == 0
    captured = capsys.readouterr()
    out = captured.out.splitlines()  # the export's line, then the done line naming hf/: one stream, in order
    assert f"] exported {tmp_path / 'hf'} in " in out[-2] and "] done: " in out[-1]
    said = [line for line in captured.err.splitlines() if "held the outputs of the run" in line]
    assert len(said) == 1 and "model.flavor debugmodel)" in said[0] and "this run: model.flavor debugmodel_mtp" in said[0]
    assert {p.name: p.read_bytes() for p in (tmp_path / f"hf-{first_id}").iterdir()} == exported
    assert "mtp" in (tmp_path / "hf" / "config.json").read_text()  # the new run's export where it belongs


def test_asked_to_delete_another_runs_outputs_a_fresh_launch_does_so_and_says_so(tmp_path, capsys):
    assert run(tmp_path, "--training.steps", "1") == 0
    first_id = run_id(tmp_path)
    capsys.readouterr()
    assert run(tmp_path, "--training.steps", "2", "--job.other_run_outputs", "delete") == 0
    said = [line for line in capsys.readouterr().err.splitlines() if f"held the outputs of the run {first_id}" in line]
    assert len(said) == 1 and "deleted (job.other_run_outputs = 'delete'): metrics.jsonl, config.toml" in said[0]
    assert [r["step"] for r in records(tmp_path / "metrics.jsonl")] == [1, 2]
    assert not list(tmp_path.glob(f"*{first_id}*"))


def test_a_fresh_relaunch_refused_by_a_full_disk_leaves_the_earlier_runs_outputs_in_place(tmp_path, capsys,
                                                                                           monkeypatch):
    """The relaunch sets the earlier run's files aside, then the disk refuses run.json: it renames them back (exit 2,
    one line saying so), and the earlier run's resume continues its own metrics.jsonl, steps 1-6 in one file."""
    import errno

    import harness.run_outputs as run_outputs

    saved = ["--checkpoint.enable", "true", "--checkpoint.interval", "4", "--checkpoint.export_hf_at_end", "true"]
    assert run(tmp_path, *saved, "--training.steps", "4") == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p.name != ".lock"}
    export = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    real = run_outputs.write_whole

    def full_disk(path, text, durable=False):
        if Path(path).name == run_outputs.RUN_FILE:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, text, durable)

    monkeypatch.setattr(run_outputs, "write_whole", full_disk)
    capsys.readouterr()
    assert run(tmp_path, "--training.steps", "2") == 2  # fresh: no checkpointing, so nothing to resume
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "No space left" in err[0] and "every output there is back under its own name" in err[0]
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file() and p.name != ".lock"} == before
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == export
    monkeypatch.undo()
    assert run(tmp_path, *saved, "--training.steps", "6") == 0
    assert [r["step"] for r in records(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert not list(tmp_path.glob("metrics-*.jsonl")) and not list(tmp_path.glob("hf-*"))


def test_a_resume_brings_back_its_own_outputs_that_a_killed_launch_left_aside(tmp_path):
    """A launch killed between its renames and run.json (SIGKILL: nothing to roll back) leaves the line's files under
    their set-aside names while run.json still names the line: its resume brings them back."""
    saved = ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    assert run(tmp_path, *saved, "--training.steps", "2") == 0
    line = run_id(tmp_path)
    (tmp_path / "metrics.jsonl").rename(tmp_path / f"metrics-{line}.jsonl")
    (tmp_path / "config.toml").rename(tmp_path / f"config-{line}.toml")
    assert run(tmp_path, *saved, "--training.steps", "3") == 0
    assert [r["step"] for r in records(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert not list(tmp_path.glob(f"*-{line}*"))


def test_relaunches_keep_the_newest_earlier_runs_outputs_up_to_the_limit_and_say_how_to_clean_up(tmp_path, capsys):
    """Every fresh relaunch sets the previous run's outputs aside, and says that they stay until deleted and how;
    with job.other_run_outputs_keep 2, only the two newest earlier runs' are kept (one line naming what went)."""
    ids = []
    for _ in range(3):
        assert run(tmp_path, "--training.steps", "1") == 0
        ids.append(run_id(tmp_path))
    err = capsys.readouterr().err
    assert "delete them by hand, or set job.other_run_outputs_keep = N" in err
    assert {p.name for p in tmp_path.glob("metrics-*.jsonl")} == {f"metrics-{i}.jsonl" for i in ids[:2]}
    assert run(tmp_path, "--training.steps", "1", "--job.other_run_outputs_keep", "2") == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "beyond the newest 2 deleted" in line]
    assert len(said) == 1 and f"metrics-{ids[0]}.jsonl" in said[0] and f"config-{ids[0]}.toml" in said[0]
    assert {p.name for p in tmp_path.glob("metrics-*.jsonl")} == {f"metrics-{i}.jsonl" for i in ids[1:]}
    assert [r["step"] for r in records(tmp_path / "metrics.jsonl")] == [1]
