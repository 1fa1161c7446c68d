"""metrics.jsonl never loses a logged step's line: each line is in the file once logged, a resumed run keeps the
lines up to its checkpoint's step on disk before it logs anything, and the lines it drops are dropped by a rename,
never by truncating the file in place."""

from __future__ import annotations

import json
from pathlib import Path

from harness.config import DEFAULT_CONFIG
from harness.metrics import MetricsLogger
from harness.train import main

FAST = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false",
        "--checkpoint.export_hf_at_end", "false"]
VALUES = {"loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 1.0, "mfu": None, "max_memory_gib": 0.1}


def steps_on_disk(folder: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (folder / "metrics.jsonl").read_text().splitlines()]


def logger(folder: Path, resume_step: int | None) -> MetricsLogger:
    return MetricsLogger(folder, 10, enable_tensorboard=False, tb_folder="tb", run_id="a-run", resume_step=resume_step)


def test_a_resumed_run_keeps_the_earlier_lines_on_disk_before_it_logs_and_each_logged_line_at_once(tmp_path):
    """What the file holds while the logger is open is what a kill at that moment leaves."""
    lines = [json.dumps({"step": s, **VALUES}) + "\n" for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines) + '{"step": 6, "lo')  # cut by a kill
    earlier = open(tmp_path / "metrics.jsonl")  # a reader of the file as it was
    resumed = logger(tmp_path, resume_step=3)
    assert steps_on_disk(tmp_path) == [1, 2, 3]  # right after the resume: the kept lines, no more, no fewer
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(lines[:3])
    assert earlier.read() == "".join(lines) + '{"step": 6, "lo'  # replaced by a rename: the old file whole
    resumed.log(4, dict(VALUES))
    assert steps_on_disk(tmp_path) == [1, 2, 3, 4]  # logged, and in the file before the logger closes
    resumed.log_validation(4, {"val_loss": 2.0, "val_tokens": 10})
    assert steps_on_disk(tmp_path) == [1, 2, 3, 4, 4]
    resumed.close()
    assert not list(tmp_path.glob(".*tmp"))


def test_a_fresh_logger_starts_the_file_and_a_resume_with_nothing_to_drop_leaves_it_untouched(tmp_path):
    """(A fresh run's trainer has set another line's file aside before: harness/run_outputs.py.)"""
    text = "".join(json.dumps({"step": s, **VALUES}) + "\n" for s in (1, 2))
    (tmp_path / "metrics.jsonl").write_text(text)
    inode = (tmp_path / "metrics.jsonl").stat().st_ino
    logger(tmp_path, resume_step=2).close()
    assert (tmp_path / "metrics.jsonl").read_text() == text and (tmp_path / "metrics.jsonl").stat().st_ino == inode
    logger(tmp_path, resume_step=None).close()  # a run from step 1, without a checkpoint: its own file
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_the_trainer_resuming_leaves_the_earlier_steps_in_the_file_before_its_first_step(tmp_path):
    """The file as a kill right after the resume leaves it: the saved run's steps up to its checkpoint."""
    from harness.config import load_config
    from harness.trainer import Trainer

    run = [*FAST, "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--metrics.log_freq", "1",
           "--job.dump_folder", str(tmp_path)]
    assert main([*run, "--training.steps", "3"]) == 0
    trainer = Trainer(load_config(["--config", str(DEFAULT_CONFIG), *run, "--training.steps", "5"]))
    try:
        assert trainer.step == 3 and steps_on_disk(tmp_path) == [1, 2, 3]
    finally:
        trainer.close()


def test_damaged_lines_are_moved_aside_counted_and_the_resume_goes_on(tmp_path, capsys):
    """A byte that is not UTF-8, a line that is not JSON and a record without a step, in the middle of the file: the
    resume keeps every good line up to its checkpoint, moves the three damaged ones (as they were) beside the file,
    and says so in one line."""
    run = [*FAST, "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--metrics.log_freq", "1",
           "--job.dump_folder", str(tmp_path)]
    assert main([*run, "--training.steps", "4"]) == 0
    path = tmp_path / "metrics.jsonl"
    good = path.read_bytes().splitlines(keepends=True)
    bad = [b'{"step": 2, "loss": 1.0, "note": "\xff\xfe"}\n', b"not json at all\n", b'{"loss": 3.0}\n']
    path.write_bytes(good[0] + bad[0] + good[1] + bad[1] + good[2] + bad[2] + good[3])
    capsys.readouterr()
    assert main([*run, "--training.steps", "6"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "damaged line" in line]
    aside = list(tmp_path.glob("metrics-damaged-*.jsonl"))
    assert len(said) == 1 and "3 damaged line(s)" in said[0] and len(aside) == 1 and aside[0].name in said[0]
    assert aside[0].read_bytes() == b"".join(bad)
    assert steps_on_disk(tmp_path) == [1, 2, 3, 4, 5, 6]
    assert path.read_bytes().startswith(b"".join(good[:4]))
