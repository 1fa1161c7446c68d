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


LORA = ["--lora.enable", "true", "--optimizer.lr", "1e-2"]


def folders(dump) -> dict[str, dict[str, bytes]]:
    """The bytes of a LoRA run's two exports."""
    return {name: {p.name: p.read_bytes() for p in (dump / name).iterdir()} for name in ("hf", "hf-adapter")}


@pytest.mark.parametrize("when", ["writing the adapter", "publishing the pair"])
def test_ctrl_c_twice_during_a_lora_runs_exports_leaves_both_of_one_step_and_names_which(
        tmp_path, capsys, monkeypatch, when):
    """The merged model and its PEFT adapter are one unit. Two Ctrl-C while the adapter is written (the merged model
    already in its temporary folder): neither is replaced, and the line says the earlier pair is left. A first Ctrl-C
    as the merged model is written, the second as the pair is renamed into place: it lands after the renames, both
    are this step's, and the line says so."""
    assert main([*FAST, *LORA, "--training.steps", "1", "--job.dump_folder", str(tmp_path)]) == 0
    earlier = folders(tmp_path)
    if when == "writing the adapter":
        write_shard, calls = hf_weights.write_shard, []

        def interrupted(path, *args, **kwargs):
            calls.append(path)
            if path.parent.name == "hf-adapter.tmp":
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
            return write_shard(path, *args, **kwargs)

        monkeypatch.setattr(hf_weights, "write_shard", interrupted)
    else:
        ctrl_c_while_exporting(monkeypatch, times=1)
        publish = hf_weights.publish_folders

        def interrupted(pairs):
            os.kill(os.getpid(), signal.SIGINT)  # held off until the renames are done
            return publish(pairs)

        monkeypatch.setattr(hf_weights, "publish_folders", interrupted)
    capsys.readouterr()
    assert main([*FAST, *LORA, "--training.steps", "2", "--job.dump_folder", str(tmp_path)]) == INTERRUPTED
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("interrupted at step 2 (Ctrl-C twice): ")]
    assert len(said) == 1 and "Traceback" not in err, err
    names = f"{tmp_path / 'hf'} and {tmp_path / 'hf-adapter'}"
    now = folders(tmp_path)
    if when == "writing the adapter":
        assert f"the Hugging Face export to {names} were not written (the earlier pair there is left" in said[0]
        assert now == earlier
    else:
        assert f"the export is written, {names}, both of step 2" in said[0]
        assert now["hf"] != earlier["hf"] and now["hf-adapter"] != earlier["hf-adapter"]
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.old"))


def test_an_export_folder_taken_during_the_training_gets_the_export_beside_it_and_one_line(tmp_path, capsys,
                                                                                          monkeypatch):
    """Something else put in hf/ after the start's check (here: as the last step runs): the run's export, which may
    be all that is saved (checkpointing off), is written beside it, and the line says where; hf/ is left as it is."""
    import harness.trainer as trainer

    run = [*FAST, "--checkpoint.enable", "false", "--training.steps", "2", "--job.dump_folder", str(tmp_path)]
    train = trainer.Trainer.train

    def train_then_take_hf(self):
        values = train(self)
        (tmp_path / "hf").mkdir()
        (tmp_path / "hf" / "notes.txt").write_text("the user's own\n")
        return values

    monkeypatch.setattr(trainer.Trainer, "train", train_then_take_hf)
    assert main(run) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    beside = tmp_path / "hf-step-2"
    assert len(err) == 1 and "is not an export of this program" in err[0], err
    assert err[0].endswith(f"this run's export was written beside it instead: {beside}")
    assert json.loads((beside / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["notes.txt"]
