"""Ctrl-C during the end-of-run Hugging Face export (harness/train.py): the first lets the export finish (it may be
the only copy of the trained weights) and the run exits 130 saying so; a second stops it at once, leaves no partial
temporary folder and the earlier export in place, and the line says what is on disk."""

from __future__ import annotations

import json
import os
import signal

import pytest

import harness.checkpoint.hf_weights as hf_weights
from harness.train import INTERRUPTED, main

FAST = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false",
        "--checkpoint.export_hf_at_end", "true", "--checkpoint.enable", "true", "--checkpoint.interval", "1"]


@pytest.fixture(autouse=True)
def signal_handlers():
    """The run installs its own SIGINT / SIGTERM handlers; pytest's come back after each test."""
    saved = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGINT, saved[0])
    signal.signal(signal.SIGTERM, saved[1])


def ctrl_c_while_exporting(monkeypatch, times: int) -> None:
    """SIGINT `times` times as the export writes its first shard."""
    write_shard, sent = hf_weights.write_shard, []

    def interrupted(*args, **kwargs):
        if not sent:
            sent.append(True)
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)
        return write_shard(*args, **kwargs)

    monkeypatch.setattr(hf_weights, "write_shard", interrupted)


def test_one_ctrl_c_during_the_export_lets_it_finish_and_exits_130_saying_so(tmp_path, capsys, monkeypatch):
    ctrl_c_while_exporting(monkeypatch, times=1)
    assert main([*FAST, "--training.steps", "1", "--job.dump_folder", str(tmp_path)]) == INTERRUPTED
    err = capsys.readouterr().err
    assert f"interrupted after the last step; the Hugging Face export was finished first: {tmp_path / 'hf'}" in err
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    assert (tmp_path / "hf" / "model.safetensors").is_file() and not (tmp_path / "hf.tmp").exists()


def test_a_second_ctrl_c_stops_the_export_leaving_no_partial_folder_and_says_what_is_on_disk(
        tmp_path, capsys, monkeypatch):
    assert main([*FAST, "--training.steps", "1", "--job.dump_folder", str(tmp_path)]) == 0
    earlier = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    ctrl_c_while_exporting(monkeypatch, times=2)
    capsys.readouterr()
    assert main([*FAST, "--training.steps", "2", "--job.dump_folder", str(tmp_path)]) == INTERRUPTED
    err = capsys.readouterr().err
    step_2 = tmp_path / "checkpoint" / "step-2"
    said = [line for line in err.splitlines() if line.startswith("interrupted at step 2 (Ctrl-C twice): ")]
    assert len(said) == 1 and "Traceback" not in err
    assert f"the Hugging Face export to {tmp_path / 'hf'} was not written" in said[0]
    assert f"the last complete checkpoint is step-2 ({step_2})" in said[0]
    assert f"python -m harness.convert {step_2} <folder> exports it" in said[0]
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == earlier
    assert not (tmp_path / "hf.tmp").exists() and not (tmp_path / "hf.old").exists()
