"""The trainer end to end on CPU: smoke run, metrics, accumulation, determinism, divergence, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.config import load_config
from harness.train import main
from tests.builders import fp32_grad_tolerance

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "train_configs" / "debug_model.toml")
CORPUS = str(REPO / "data" / "debug_corpus" / "train.jsonl")
FAST = ["--training.seq_len", "64", "--training.local_batch_size", "4", "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false", "--training.dataset_path", CORPUS]


def _run(tmp_path, *extra) -> int:
    return main(["--config", CONFIG, *FAST, "--job.dump_folder", str(tmp_path / "out"), *extra])


def _metrics(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]


def test_smoke_run_loss_falls_and_metrics_have_the_keys(tmp_path, capsys):
    assert _run(tmp_path, "--training.steps", "20", "--metrics.enable_tensorboard", "true", "--job.name", "smoke") == 0
    assert "[smoke] step 20/20" in capsys.readouterr().out  # job.name labels the console lines
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 21))
    for key in ("step", "loss", "grad_norm", "expert_load", "lr", "tokens_per_sec", "mfu", "max_memory_gib"):
        assert key in rows[0], key
    assert "ep_rank_load" not in rows[0]  # only under expert parallelism
    # The busiest of the debug model's 8 experts, against an even split: at least 1, at most 8 (all on one).
    assert all(1.0 <= r["expert_load"] <= 8.0 for r in rows)
    assert rows[0]["mfu"] is None  # CPU: no peak to divide by
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "out" / "tb").glob("*/*"))


def test_a_fresh_run_keeps_its_tensorboard_events_apart_from_an_earlier_run(tmp_path):
    flags = ["--training.steps", "1", "--metrics.enable_tensorboard", "true"]
    assert _run(tmp_path, *flags) == 0
    assert _run(tmp_path, *flags) == 0  # in the same second, maybe: run ids carry a random part too
    runs = sorted(p for p in (tmp_path / "out" / "tb").iterdir())
    assert len(runs) == 2 and all(any(f.name.startswith("events.out.tfevents") for f in r.iterdir()) for r in runs)
    # each folder is named by its run's id: the second run's in run.json, the first's on its metrics set aside
    names = {json.loads((tmp_path / "out" / "run.json").read_text())["run"]}
    names |= {p.name.removeprefix("metrics-").removesuffix(".jsonl") for p in (tmp_path / "out").glob("metrics-*")}
    assert names == {r.name for r in runs}


def test_a_row_longer_than_the_dataset_is_one_error_line_and_exit_2(tmp_path, capsys):
    # The debug corpus holds ~972k tokens: a 1M-token row cannot be cut from it (seen as a bare traceback on GPU).
    assert _run(tmp_path, "--training.seq_len", str(2**20), "--training.local_batch_size", "1") == 2
    err = capsys.readouterr().err
    assert "error: dataset cache" in err and "too few for one row of seq_len 1048576" in err
    assert "Traceback" not in err


def test_deterministic_runs_repeat_exactly(tmp_path, deterministic_off_after):
    flags = ["--training.steps", "3", "--training.deterministic", "true"]
    assert _run(tmp_path / "a", *flags) == 0
    assert _run(tmp_path / "b", *flags) == 0
    losses = lambda d: [r["loss"] for r in _metrics(d)]
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_mtp"])
def test_gradient_accumulation_equals_one_big_batch(tmp_path, flavor):
    """Two microbatches of 2 rows give the same gradients as one microbatch of 4: the loss (and the MTP loss, each
    depth's token mean over its own targets) is the token mean over the global batch however it is split. (The MoE
    balance loss is off: it is computed per microbatch, so it legitimately depends on the split.)"""
    from harness.trainer import Trainer

    def trainer(local, global_):
        cfg = load_config(["--config", CONFIG, *FAST, "--job.dump_folder", str(tmp_path / f"t{local}"),
                           "--training.local_batch_size", str(local), "--training.global_batch_size", str(global_),
                           "--training.aux_loss_coef", "0", "--model.flavor", flavor])
        return Trainer(cfg)

    big, small = trainer(4, 4), trainer(2, 4)
    assert small.layout.grad_accum_steps == 2
    batch = next(iter(big.dataloader))
    batch["labels"][0, :10] = -100  # uneven label counts between the two halves
    halves = [{k: v[i : i + 2] for k, v in batch.items()} for i in (0, 2)]
    out_big, out_small = big.train_step([batch]).read(), small.train_step(halves).read()
    assert out_small["loss"] == pytest.approx(out_big["loss"], rel=1e-6)
    if flavor == "debugmodel_mtp":
        assert out_small["mtp_loss"] == pytest.approx(out_big["mtp_loss"], rel=1e-6)
    assert out_small["grad_norm"] == pytest.approx(out_big["grad_norm"], rel=1e-5)
    # Gradients (kept after the step), not updated weights: Adam's first update is ~lr * sign(grad),
    # which turns fp32 summation-order noise in near-zero gradients into lr-sized differences.
    for (name, a), b in zip(big.model.named_parameters(), small.model.parameters()):
        rel = ((a.grad - b.grad).norm() / a.grad.norm()).item()
        assert rel < fp32_grad_tolerance(name), f"{name}: relative grad difference {rel:.2e}"


def test_nan_loss_stops_with_the_step_named(tmp_path, capsys):
    assert _run(tmp_path, "--training.steps", "6", "--optimizer.lr", "1e30", "--lr_scheduler.warmup_steps", "0") == 3
    err = capsys.readouterr().err
    assert "error: step" in err and ("nan" in err or "inf" in err)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--training.steps", "banana"], "training.steps"),
        (["--training.step", "5"], "did you mean --training.steps"),
        (["--config", "/nonexistent/run.toml"], "/nonexistent/run.toml"),
        (["--parallelism.data_parallel_shard_degree", "2"], "world size is 1"),
        (["--training.dataset_path", "/nonexistent/corpus.jsonl"], "/nonexistent/corpus.jsonl"),
        (["--model.flavor", "tiny"], "model.flavor 'tiny' is not a known flavor"),
        (["--model.tokenizer_path", "/tmp"], "'/tmp' holds no tokenizer.json"),
        (["--training.gc_freq", "-1"], "training.gc_freq must be >= 0"),
    ],
)
def test_bad_input_exits_2_naming_the_problem_and_writes_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    assert main(["--config", CONFIG, "--job.dump_folder", str(out), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_malformed_toml_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nsteps = 10\nseq_len = = 4\n")
    assert main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "line 3" in err


def test_readme_train_command_runs(tmp_path):
    """The README's training command (with a short run) works from the repository root."""
    env = {**os.environ, "NGPU": "1", "PYTHON": sys.executable}  # the interpreter under test, not PATH's python3
    result = subprocess.run(
        ["./run_train.sh", "--training.steps", "2", "--training.seq_len", "64", "--job.dump_folder", str(tmp_path / "o")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "step 2/2" in result.stdout
    assert (tmp_path / "o" / "metrics.jsonl").is_file()


def test_hf_export_at_end_loads_in_transformers_with_our_logits(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from models.qwen35_moe import from_pretrained
    from tests.hf_reference import force_transformers_torch_kernels

    force_transformers_torch_kernels(monkeypatch)
    assert _run(tmp_path, "--training.steps", "2", "--checkpoint.export_hf_at_end", "true",
                "--checkpoint.export_dtype", "float32") == 0
    folder = tmp_path / "out" / "hf"
    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    ids = torch.randint(0, 258, (1, 50))
    with torch.no_grad():
        diff = (hf(input_ids=ids).logits - from_pretrained(folder)(ids).logits).abs().max().item()
    assert diff < 1e-4


def test_validation_loss_is_the_token_mean_over_the_same_held_out_rows_each_time(tmp_path):
    """The validator's loss equals cross entropy summed by hand over the first `steps` batches of the validation
    set (reached through the loader, so the same rows), and two validations see the same rows."""
    import torch.nn.functional as F

    from harness.data.loader import build_dataloader
    from harness.trainer import Trainer

    cfg = load_config(["--config", CONFIG, *FAST, "--job.dump_folder", str(tmp_path / "out"),
                       "--validation.enable", "true", "--validation.dataset_path", CORPUS, "--validation.steps", "3"])
    trainer = Trainer(cfg)
    first = trainer.validator.validate(trainer.model)
    assert trainer.validator.validate(trainer.model) == first
    assert trainer.model.training  # back in training mode afterwards

    loader = build_dataloader("jsonl", CORPUS, "text", trainer.tokenizer, 64, 4,
                              cache_dir=str(tmp_path / "out" / "dataset_cache"), infinite=False)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for _ in range(3):
            batch = next(loader)
            logits = trainer.model(batch["input_ids"], batch["position_ids"]).logits
            total += F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum").item()
            tokens += int((batch["labels"] != -100).sum())
    assert first["val_tokens"] == tokens
    assert first["val_loss"] == pytest.approx(total / tokens, rel=1e-6)
    trainer.close()


def test_a_tiny_dataset_does_not_log_every_epoch(tmp_path, caplog):
    import logging

    from harness.data.loader import build_dataloader
    from harness.data.tokenizer import ByteTokenizer

    corpus = tmp_path / "tiny.jsonl"
    corpus.write_text('{"text": "' + "x" * 300 + '"}\n')  # ~300 tokens: 4 rows of 64, then it wraps
    loader = build_dataloader("jsonl", str(corpus), "text", ByteTokenizer(), 64, 1, cache_dir=str(tmp_path / "c"))
    with caplog.at_level(logging.INFO, logger="harness.data"):
        for _ in range(4 * 100):  # 100 epochs
            next(loader)
    epoch_lines = [r for r in caplog.records if "epoch" in r.getMessage()]
    assert 1 <= len(epoch_lines) <= 7  # epochs 1, 2, 4, ..., 64


def test_garbage_collection_runs_every_gc_freq_steps_and_is_restored(tmp_path, monkeypatch):
    """training.gc_freq: Python's collector off during the run, a young-generation collection every N steps."""
    import gc

    calls = []
    collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append((generation, gc.isenabled())) or
                        collect(generation))
    assert gc.isenabled()
    assert _run(tmp_path, "--training.steps", "7", "--training.gc_freq", "3") == 0
    young = [c for c in calls if c[0] == 1]
    assert young == [(1, False)] * 3  # before step 1, at steps 3 and 6; the collector disabled meanwhile
    assert gc.isenabled()


def test_a_due_step_is_read_after_the_next_step_is_queued(tmp_path, monkeypatch):
    """With log_freq 1 on CUDA the host reads step t's metrics only once step t + 1 is queued (a read waits for the
    GPU: made at once it leaves the GPU idle while the host queues the next forward); the first and last steps and
    a step that saves are read at once. Every step is still logged, with its own values."""
    from harness.step_metrics import StepLog
    reads = []  # (steps read, step queued last) per host read
    real_read = StepLog.read

    def spy(self, through=None):
        ready = [v.step for v in self.unread if through is None or v.step <= through]
        if ready:
            reads.append((ready, self.unread[-1].step))
        return real_read(self, through)

    monkeypatch.setattr(StepLog, "read", spy)
    # On CPU each step is read as soon as it has run (a late read gains nothing where the device does not run
    # ahead, and would count the next step's time in this step's rate).
    assert _run(tmp_path / "cpu", "--training.steps", "3") == 0
    assert reads == [([1], 1), ([2], 2), ([3], 3)]
    reads.clear()
    monkeypatch.setattr(StepLog, "read_late", True)  # as on CUDA
    assert _run(tmp_path, "--training.steps", "6", "--checkpoint.enable", "true", "--checkpoint.interval", "4") == 0
    assert reads == [([1], 1), ([2], 3), ([3], 4), ([4], 4), ([5], 6), ([6], 6)]
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # the same values as a run that reads every step at once (the log_freq 1 path before the lag)
    monkeypatch.setattr(StepLog, "read", real_read)
    assert _run(tmp_path / "eager", "--training.steps", "6", "--metrics.log_freq", "100") == 0
    assert rows[-1]["loss"] == _metrics(tmp_path / "eager")[-1]["loss"]


def test_training_batches_take_the_packed_layout_also_when_each_row_holds_one_document(tmp_path):
    """One path through the kernels and compiled graphs whatever the data (documents.document_layout's `packed`;
    tests/unit/test_packed_layout.py checks that path against the plain one)."""
    from harness.trainer import Trainer

    trainer = Trainer(load_config(["--config", CONFIG, *FAST, "--job.dump_folder", str(tmp_path / "out")]))
    rows = torch.zeros(4, 64, dtype=torch.long)
    whole_rows, packed = ({"input_ids": rows, "labels": rows, "position_ids": (torch.arange(64) % n).expand(4, 64)}
                          for n in (64, 40))  # one document per row; two per row (40 and 24 tokens)
    assert trainer.model_inputs(whole_rows)["layout"].cu_seqlens.tolist() == [0, 64, 128, 192, 256]
    layout = trainer.model_inputs(packed)["layout"]
    assert layout.is_packed and layout.cu_seqlens[0] == 0 and layout.cu_seqlens[-1] == 4 * 64
    trainer.close()
