"""A relaunch that resumes a checkpoint trains with the relaunch's config: new optimizer settings and schedule apply
on top of the loaded state; a changed dataset, tokenizer or seq_len stops the run unless the data restarts."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from harness.config import load_config
from harness.optim.lr_schedule import lr_factor
from harness.train import main
from harness.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "train_configs" / "debug_model.toml")
CORPUS = str(REPO / "data" / "debug_corpus" / "train.jsonl")
FAST = ["--config", CONFIG, "--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false", "--training.dataset_path", CORPUS, "--checkpoint.enable", "true",
        "--checkpoint.interval", "4", "--checkpoint.export_hf_at_end", "false", "--lr_scheduler.warmup_steps", "2"]
NEW_OPTIMIZER = ["--optimizer.lr", "2e-4", "--optimizer.weight_decay", "0.05", "--optimizer.betas", "0.8,0.9",
                 "--optimizer.eps", "1e-6", "--optimizer.name", "Adam"]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> Path:
    """A dump folder holding the checkpoint of step 4 (of 4), trained at the debug config's lr 3e-3."""
    out = tmp_path_factory.mktemp("resume_config") / "out"
    assert main([*FAST, "--job.dump_folder", str(out), "--training.steps", "4"]) == 0
    return out


def _relaunch(out: Path, tmp_path: Path, *flags: str) -> Trainer:
    """A Trainer for a relaunch on a copy of `out` (so each test resumes the same step-4 checkpoint)."""
    import shutil

    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    return Trainer(load_config([*FAST, "--job.dump_folder", str(copy), *flags]))


def test_new_optimizer_settings_apply_on_top_of_the_loaded_state(four_steps, tmp_path, caplog):
    same = _relaunch(four_steps, tmp_path / "same", "--training.steps", "8")
    with caplog.at_level(logging.INFO, logger="harness"):
        changed = _relaunch(four_steps, tmp_path / "changed", "--training.steps", "8", *NEW_OPTIMIZER)
    try:
        assert same.step == changed.step == 4
        # The Adam moments and step counts are the checkpoint's in both...
        for p_same, p_changed in zip(same.optimizer.param_groups[0]["params"], changed.optimizer.param_groups[0]["params"]):
            s, c = same.optimizer.state[p_same], changed.optimizer.state[p_changed]
            assert float(s["step"]) == float(c["step"]) == 4.0
            torch.testing.assert_close(s["exp_avg"], c["exp_avg"], rtol=0, atol=0)
            torch.testing.assert_close(s["exp_avg_sq"], c["exp_avg_sq"], rtol=0, atol=0)
        # ...and the hyperparameters are each launch's own: the debug config's, then the new ones.
        decay, no_decay = same.optimizer.param_groups
        assert (decay["weight_decay"], no_decay["weight_decay"], decay["decoupled_weight_decay"]) == (0.1, 0.0, True)
        decay, no_decay = changed.optimizer.param_groups
        assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.05, 0.0)
        for group in (decay, no_decay):
            assert (tuple(group["betas"]), group["eps"], group["decoupled_weight_decay"]) == ((0.8, 0.9), 1e-6, False)
        # The lr of the next update (step 5 of 8): the peak times the schedule's factor there (warmup 2, cosine).
        assert same.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 * lr_factor(5, 8, 2, None, "cosine", 0.1))
        assert changed.optimizer.param_groups[0]["lr"] == pytest.approx(2e-4 * lr_factor(5, 8, 2, None, "cosine", 0.1))
        logged = caplog.text
        for line in ("optimizer.lr 0.003 -> 0.0002", "optimizer.weight_decay 0.1 -> 0.05",
                     "optimizer.betas [0.9, 0.95] -> [0.8, 0.9]", "optimizer.eps 1e-08 -> 1e-06",
                     "optimizer.name AdamW -> Adam"):
            assert line in logged, line
    finally:
        same.close()
        changed.close()


def test_a_resumed_run_logs_the_lr_of_the_new_setting_at_every_step(four_steps, tmp_path):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(four_steps, out)
    assert main([*FAST, "--job.dump_folder", str(out), "--training.steps", "8", "--optimizer.lr", "2e-4"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in rows}
    for step in range(1, 5):  # the first launch: peak 3e-3 over a 4-step schedule
        assert lrs[step] == pytest.approx(3e-3 * lr_factor(step, 4, 2, None, "cosine", 0.1))
    for step in range(5, 9):  # the relaunch: peak 2e-4 over its 8-step schedule
        assert lrs[step] == pytest.approx(2e-4 * lr_factor(step, 8, 2, None, "cosine", 0.1))
    saved = (out / "config.toml").read_text()
    assert "lr = 0.0002" in saved and "steps = 8" in saved  # config.toml records what the run uses


def test_a_changed_seq_len_or_dataset_stops_the_resume_naming_each_difference(four_steps, tmp_path, capsys):
    import shutil

    other = tmp_path / "other.jsonl"  # the same documents under another name, and one more: another token stream
    other.write_text(Path(CORPUS).read_text() + json.dumps({"text": "one more document"}) + "\n")
    out = tmp_path / "out"
    shutil.copytree(four_steps, out)
    flags = [*FAST, "--job.dump_folder", str(out), "--training.steps", "6", "--training.seq_len", "32",
             "--training.dataset_path", str(other)]
    assert main(flags) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line or "Traceback" in line]
    assert len(err) == 1 and err[0].startswith("error: checkpoint ")
    assert "training.seq_len 64 -> 32" in err[0] and f"-> {str(other)!r}" in err[0]
    assert "checkpoint.restart_data = true" in err[0]
    assert not (out / "checkpoint" / "step-6").exists()  # nothing trained, the checkpoint as it was
    assert (out / "checkpoint" / "step-4" / "COMPLETE").is_file()

    # Restarting the data: the weights and optimizer resume, the rows start over (the fresh run's first rows).
    restarted = Trainer(load_config([*flags, "--checkpoint.restart_data", "true"]))
    fresh = Trainer(load_config([*flags[:-8], "--job.dump_folder", str(tmp_path / "fresh"), "--training.seq_len", "32",
                                 "--training.dataset_path", str(other), "--checkpoint.enable", "false"]))
    try:
        assert restarted.step == 4 and fresh.step == 0
        # config.toml continues the run: it holds neither this launch's restart of the data nor a load_step
        saved = (out / "config.toml").read_text()
        assert "restart_data = false" in saved and "load_step = -1" in saved
        first = next(iter(restarted.dataloader))
        torch.testing.assert_close(first["input_ids"], next(iter(fresh.dataloader))["input_ids"], rtol=0, atol=0)
    finally:
        restarted.close()
        fresh.close()


def test_a_longer_run_says_what_it_does_to_the_schedule(four_steps, tmp_path, caplog):
    """training.steps 4 -> 8 stretches the cosine decay: step 5 runs at a higher lr than the saved schedule's step 5
    (its floor: min_lr_factor), and the start says so with both figures."""
    with caplog.at_level(logging.INFO, logger="harness"):
        trainer = _relaunch(four_steps, tmp_path, "--training.steps", "8")
    trainer.close()
    before, after = 3e-3 * lr_factor(5, 4, 2, None, "cosine", 0.1), 3e-3 * lr_factor(5, 8, 2, None, "cosine", 0.1)
    assert after > before
    assert (f"the LR schedule is this launch's: step 5 runs at lr {after:.3g}, up from {before:.3g} under the "
            "checkpoint's") in caplog.text


def test_a_relaunch_from_its_own_config_toml_with_a_relative_dump_folder_lists_no_change(tmp_path, monkeypatch,
                                                                                          capsys):
    """`--job.dump_folder outputs/ck2` (relative), then `--config outputs/ck2/config.toml` (every path absolute): the
    same folder, so no `job.dump_folder 'outputs/ck2' -> '/abs/outputs/ck2'` line; nothing else changed either."""
    monkeypatch.chdir(tmp_path)
    assert main([*FAST, "--job.dump_folder", "outputs/ck2", "--training.steps", "4"]) == 0
    capsys.readouterr()
    assert main(["--config", "outputs/ck2/config.toml", "--training.steps", "4"]) == 0
    err = capsys.readouterr().err
    assert "resumed from checkpoint" in err and "changed since the checkpoint" not in err, err
