"""Checkpoints across processes, through run_train.sh as a user runs it (FSDP over 2 gloo ranks on CPU):
SIGTERM mid-run then relaunch equals the uninterrupted run bit for bit; a checkpoint saved by 2 ranks resumes
on 1 and the reverse, also from and to context parallelism, expert parallelism, and FSDP's embedding and lm_head
(the default here is vocabulary-parallel); Ctrl-C stops
with one line, after saving."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.convert import main as convert_main

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
         "--training.steps", "8", "--training.deterministic", "true", "--metrics.log_freq", "1",
         "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "true", "--checkpoint.keep_latest_k", "0"]


def launch(dump: Path, ngpu: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "NGPU": str(ngpu), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([str(REPO / "run_train.sh"), *FLAGS, "--job.dump_folder", str(dump), *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def run(dump: Path, ngpu: int, *extra: str) -> subprocess.CompletedProcess:
    proc = launch(dump, ngpu, *extra)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def signal_after_step(dump: Path, ngpu: int, step: int, signum: int) -> subprocess.CompletedProcess:
    """Launch, and when `step` is logged send `signum` to every process of the job (as SLURM does)."""
    proc = launch(dump, ngpu)
    out = []
    for line in proc.stdout:
        out.append(line)
        if f"step {step}/8" in line:
            os.killpg(proc.pid, signum)
            break
    rest, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(out) + rest, err)


def losses(dump: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """8 steps on 2 ranks and on 1, each saving at steps 4 and 8."""
    tmp = tmp_path_factory.mktemp("resume")
    for ngpu in (1, 2):
        run(tmp / f"ref{ngpu}", ngpu, "--checkpoint.interval", "4")
    return tmp


def test_sigterm_saves_exits_0_and_the_relaunch_equals_the_uninterrupted_run_bitwise(uninterrupted, tmp_path):
    stopped = signal_after_step(tmp_path, 2, 3, signal.SIGTERM)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    lines = [line for line in stopped.stderr.splitlines() if "stopped on SIGTERM" in line]
    assert len(lines) == 1 and "saved checkpoint" in lines[0], stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr and "error:" not in stopped.stderr
    resumed = run(tmp_path, 2)
    assert "resumed from checkpoint" in resumed.stderr
    assert losses(tmp_path) == losses(uninterrupted / "ref2")  # every step, to the last bit


@pytest.mark.parametrize("saved_by, resumed_by", [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_on_another_number_of_ranks(uninterrupted, tmp_path, saved_by, resumed_by):
    ref = uninterrupted / f"ref{saved_by}"
    shutil.copytree(ref, tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-8")  # as if the job had died after step 4's save
    result = run(tmp_path / "run", resumed_by, "--checkpoint.interval", "4")
    assert "resumed from checkpoint" in result.stderr and f"saved by {saved_by} ranks, resumed by {resumed_by}" in result.stderr
    want, got = losses(ref), losses(tmp_path / "run")
    assert sorted(got) == list(range(1, 9))
    for step in range(5, 9):  # the same weights, optimizer and rows; other summation order: ~1e-7 relative
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


CP2 = ("--parallelism.context_parallel_degree", "2")


@pytest.mark.parametrize("saved_with_cp", [True, False])
def test_a_checkpoint_moves_between_context_parallel_and_one_process(uninterrupted, tmp_path, saved_with_cp):
    """CP=2 over 2 ranks reads the rows one process reads (one data-parallel rank): saved with CP=2 and resumed
    by one process, or the reverse, the run continues the one-process run."""
    ref = uninterrupted / "ref1"
    if saved_with_cp:
        run(tmp_path / "run", 2, *CP2, "--checkpoint.interval", "4")
        full = losses(tmp_path / "run")
        for step in range(1, 9):  # CP=2 trains like one process (other summation order only)
            assert full[step] == pytest.approx(losses(ref)[step], rel=1e-5), step
    else:
        shutil.copytree(ref, tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-8")  # as if the job had died after step 4's save
    metrics = tmp_path / "run" / "metrics.jsonl"  # keep steps 1-4: steps 5-8 must come from the resumed run
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()[:4]))
    result = run(tmp_path / "run", *((1,) if saved_with_cp else (2, *CP2)), "--checkpoint.interval", "4")
    assert "resumed from checkpoint" in result.stderr
    got, want = losses(tmp_path / "run"), losses(ref)
    assert sorted(got) == list(range(1, 9))
    for step in range(5, 9):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


EP2 = ("--parallelism.expert_parallel_degree", "2")


@pytest.mark.parametrize("saved_with_ep", [True, False])
def test_a_checkpoint_moves_between_expert_parallel_and_fsdp(uninterrupted, tmp_path, saved_with_ep):
    """EP=2 over 2 ranks (each rank holds half of every layer's experts) trains like FSDP=2 (each rank holds half
    of every expert's rows): a checkpoint of one resumes in the other. The first resumed step is bitwise the
    step the saving run took, so weights, optimizer state and data position came back whole."""
    if saved_with_ep:
        run(tmp_path / "saved", 2, *EP2, "--checkpoint.interval", "4")
        for step, loss in losses(uninterrupted / "ref2").items():  # EP changes no number here (measured: bitwise)
            assert losses(tmp_path / "saved")[step] == pytest.approx(loss, rel=1e-6), step
        # The offline converter reads the EP-sharded experts of the DCP step into the end-of-run export's bytes.
        assert convert_main([str(tmp_path / "saved" / "checkpoint" / "step-8"), str(tmp_path / "converted")]) == 0
        for exported in (tmp_path / "saved" / "hf").glob("*.safetensors"):
            assert (tmp_path / "converted" / exported.name).read_bytes() == exported.read_bytes(), exported.name
    else:
        shutil.copytree(uninterrupted / "ref2", tmp_path / "saved")
    shutil.copytree(tmp_path / "saved", tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-8")  # as if the job had died after step 4's save
    metrics = tmp_path / "run" / "metrics.jsonl"  # keep steps 1-4: steps 5-8 must come from the resumed run
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()[:4]))
    result = run(tmp_path / "run", 2, *(() if saved_with_ep else EP2), "--checkpoint.interval", "4")
    assert "resumed from checkpoint" in result.stderr
    got, want = losses(tmp_path / "run"), losses(tmp_path / "saved")
    assert sorted(got) == list(range(1, 9))
    assert got[5] == want[5]
    for step in range(6, 9):  # measured: bitwise up to step 7, then 1e-7 (other gradient summation order)
        assert got[step] == pytest.approx(want[step], rel=1e-6), step


FSDP_VOCAB = ("--parallelism.vocab_parallel", "never")


@pytest.mark.parametrize("saved_vocab_parallel", [True, False])
def test_a_checkpoint_moves_between_vocab_parallel_and_fsdp_units(uninterrupted, tmp_path, saved_vocab_parallel):
    """The vocabulary-parallel embedding and lm_head keep FSDP's layout of their weights: a checkpoint of either way
    resumes in the other, and the run continues the saving run's losses."""
    if saved_vocab_parallel:  # the 2-rank reference: 2 ranks x 128 tokens <= 512 vocabulary rows, "auto" takes it
        shutil.copytree(uninterrupted / "ref2", tmp_path / "saved")
    else:
        run(tmp_path / "saved", 2, *FSDP_VOCAB, "--checkpoint.interval", "4")
        # Other summation order only: in float64 the two layouts' losses agree to 2e-16 at every step. In fp32 AdamW
        # turns summation noise in near-zero gradients into lr-sized updates (its first ones are ~lr * sign(grad)),
        # and two summation orders of one run drift apart over the 8 steps: measured up to 1.8e-5 relative here
        # (step 7), 2.8e-5 between one process and 2 ranks (test_a_checkpoint_resumes_on_another_number_of_ranks's
        # runs, step 8). A wrong vocabulary slice is off by orders of magnitude more.
        for step, loss in losses(uninterrupted / "ref2").items():
            assert losses(tmp_path / "saved")[step] == pytest.approx(loss, rel=5e-5), step
    shutil.copytree(tmp_path / "saved", tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-8")  # as if the job had died after step 4's save
    metrics = tmp_path / "run" / "metrics.jsonl"  # keep steps 1-4: steps 5-8 must come from the resumed run
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()[:4]))
    result = run(tmp_path / "run", 2, *(FSDP_VOCAB if saved_vocab_parallel else ()), "--checkpoint.interval", "4")
    assert "resumed from checkpoint" in result.stderr
    got, want = losses(tmp_path / "run"), losses(tmp_path / "saved")
    assert sorted(got) == list(range(1, 9))
    for step in range(5, 9):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


def test_a_tied_model_resumes_on_two_ranks_bitwise_and_exports_one_matrix(tmp_path):
    """tie_word_embeddings through FSDP's checkpoint: the shared weight (one parameter, in the root unit) saves and
    resumes, the resumed steps equal the uninterrupted run's bit for bit, and the export writes the one matrix
    (no lm_head.weight), which loads back tied."""
    import dataclasses

    from safetensors import safe_open

    from models.qwen35_moe import from_pretrained, get_flavor

    config = tmp_path / "config.json"
    args = dataclasses.replace(get_flavor("debugmodel"), tie_word_embeddings=True)
    config.write_text(json.dumps(args.to_hf_config()))
    tied = ("--model.hf_config", str(config), "--checkpoint.interval", "4")
    run(tmp_path / "full", 2, *tied)
    shutil.copytree(tmp_path / "full", tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-8")  # as if the job had died after step 4's save
    metrics = tmp_path / "run" / "metrics.jsonl"  # keep steps 1-4: steps 5-8 must come from the resumed run
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()[:4]))
    assert "resumed from checkpoint" in run(tmp_path / "run", 2, *tied).stderr
    assert losses(tmp_path / "run") == losses(tmp_path / "full")
    hf = tmp_path / "run" / "hf"
    keys = {key for path in hf.glob("*.safetensors") for key in safe_open(path, "pt").keys()}
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    model = from_pretrained(hf)
    assert model.lm_head.weight is model.embed_tokens.weight


def test_async_saves_on_two_ranks_change_nothing_and_complete(uninterrupted, tmp_path):
    run(tmp_path, 2, "--checkpoint.interval", "4", "--checkpoint.async_mode", "async")
    assert losses(tmp_path) == losses(uninterrupted / "ref2")
    assert sorted(p.parent.name for p in (tmp_path / "checkpoint").glob("step-*/COMPLETE")) == ["step-4", "step-8"]


def test_ctrl_c_saves_and_stops_with_one_line(tmp_path):
    stopped = signal_after_step(tmp_path, 2, 2, signal.SIGINT)
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    lines = [line for line in stopped.stderr.splitlines() if "interrupted at step" in line]
    assert len(lines) == 1 and "saved checkpoint" in lines[0]
    assert "Traceback" not in stopped.stderr
    assert any((tmp_path / "checkpoint").glob("step-*/COMPLETE"))


def test_a_four_rank_composed_checkpoint_resumes_on_two_ranks_and_on_one(tmp_path):
    """FSDP=2 x CP=2 with EP=2 over 4 ranks (issue 12's layout, on CPU), saved at step 2: resumed by plain FSDP
    over 2 ranks and by one process, each continues the 4-rank run (same global batch: 2 rows per step)."""
    composed = ("--parallelism.data_parallel_shard_degree", "2", "--parallelism.context_parallel_degree", "2",
                *EP2)
    short = ("--training.steps", "4", "--checkpoint.interval", "2", "--training.local_batch_size", "1",
             "--training.global_batch_size", "2")
    run(tmp_path / "saved", 4, *composed, *short)
    want = losses(tmp_path / "saved")
    for ngpu in (2, 1):
        resumed = tmp_path / f"on{ngpu}"
        shutil.copytree(tmp_path / "saved", resumed)
        shutil.rmtree(resumed / "checkpoint" / "step-4")
        shutil.rmtree(resumed / "hf")
        (resumed / "metrics.jsonl").write_text("".join(
            line + "\n" for line in (resumed / "metrics.jsonl").read_text().splitlines()[:2]))
        local = ("--training.local_batch_size", str(2 // ngpu))
        result = run(resumed, ngpu, *short, *local)
        assert "resumed from checkpoint" in result.stderr and f"saved by 4 ranks, resumed by {ngpu}" in result.stderr
        got = losses(resumed)
        for step in (3, 4):  # other summation order (CP's head-parallel GDN, EP's expert sums): ~1e-7 relative
            assert got[step] == pytest.approx(want[step], rel=1e-5), (ngpu, step)
        # The export of the resumed run holds the same tensors as the 4-rank run's (same keys; values within fp32
        # summation-order noise after two more steps).
        assert sorted(p.name for p in (resumed / "hf").iterdir()) == sorted(p.name for p in (tmp_path / "saved" / "hf").iterdir())
