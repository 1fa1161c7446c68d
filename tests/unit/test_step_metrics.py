"""Every logged step's tokens/s and MFU are that step's own, also where the metrics are read one step late (as on a
GPU, which runs behind the host): a step is timed on the device's timeline (metrics.DeviceClock), not by when the
host reads it. On CPU the late read is forced and the clock is a fake that only the steps advance, so each step
takes a known time and every figure has one right value."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from harness.config import load_config
from harness.step_metrics import StepLog
from harness.trainer import Trainer
from models.qwen35_moe.flops import training_flops_per_token

REPO = Path(__file__).resolve().parents[2]
SEQ, BATCH = 64, 2
SECONDS = [0.5, 0.25, 0.125, 1.0, 2.0, 0.75]  # each step's time on the (fake) device


@pytest.fixture(scope="module")
def dataset_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("dataset_cache")  # the debug corpus tokenized once for both runs


@pytest.mark.parametrize("log_freq", [1, 2])
def test_each_logged_step_reports_its_own_rate_and_mfu_when_read_late(tmp_path, monkeypatch, dataset_cache, log_freq):
    clock = {"now": 1000.0}
    monkeypatch.setattr(time, "perf_counter", lambda: clock["now"])
    monkeypatch.setattr(StepLog, "read_late", property(lambda self: True))
    step = Trainer._step

    def timed_step(self, microbatches):
        values = step(self, microbatches)
        clock["now"] += SECONDS[self.step - 1]
        return values

    monkeypatch.setattr(Trainer, "_step", timed_step)
    cfg = load_config(["--config", str(REPO / "train_configs" / "debug_model.toml"), "--training.seq_len", str(SEQ),
                       "--training.local_batch_size", str(BATCH), "--training.steps", str(len(SECONDS)),
                       "--metrics.log_freq", str(log_freq), "--metrics.enable_tensorboard", "false",
                       "--checkpoint.export_hf_at_end", "false", "--job.dump_folder", str(tmp_path),
                       "--training.dataset_cache_dir", str(dataset_cache)])
    trainer = Trainer(cfg)
    trainer.steps.peak_flops = 1e12  # as on a GPU, so that MFU is logged
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r["step"] for r in rows]
    assert logged == ([1, 2, 3, 4, 5, 6] if log_freq == 1 else [1, 2, 4, 6])
    previous = 0
    for row in rows:
        steps = range(previous + 1, row["step"] + 1)  # the steps since the last logged one
        seconds = sum(SECONDS[s - 1] for s in steps)
        assert row["tokens_per_sec"] == pytest.approx(len(steps) * SEQ * BATCH / seconds, rel=1e-9), row["step"]
        # MFU: the rate times the step's FLOPs per token over the peak; a query attends to 1 to SEQ keys of its
        # document.
        per_token = row["mfu"] * 1e12 / row["tokens_per_sec"]
        fewest, most = (training_flops_per_token(trainer.model_args, keys) for keys in (1, SEQ))
        assert fewest < per_token < most, row["step"]
        previous = row["step"]
