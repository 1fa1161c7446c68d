"""Checkpoints across processes (FSDP over 2 gloo ranks on CPU): SIGTERM mid-run (run_train.sh as a user runs it)
then relaunch equals the uninterrupted run bit for bit; a checkpoint saved by 2 ranks resumes on 1 and the reverse,
also from and to context parallelism, expert parallelism, and FSDP's embedding and lm_head (the default here is
vocabulary-parallel); Ctrl-C stops with one line, after saving; a checkpoint that fails verification on one rank is
skipped by both.

The runs are the training entry point each rank of run_train.sh runs (tests/distributed/train_worker.py), in the
shared launches (tests/distributed/launch.py): the uninterrupted runs first, then the relaunches, each on a copy of
the folder of the run it resumes, as the job that died after a save left it."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.convert import main as convert_main
from tests.checkpoint_faults import flip_bytes
from tests.distributed.launch import Run, register, started_processes
from tests.distributed.train_worker import logged, losses

REPO = Path(__file__).resolve().parents[2]
TRAIN = "tests.distributed.train_worker:train"
FLAGS = ("--training.seq_len", "64", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
         "--training.steps", "8", "--training.deterministic", "true", "--metrics.log_freq", "1",
         "--metrics.enable_tensorboard", "false", "--checkpoint.enable", "true", "--checkpoint.keep_latest_k", "0")
EVERY_4 = (*FLAGS, "--checkpoint.interval", "4")  # saves at steps 4 and 8


def signalled(folder: Path, step: int, signum: int) -> None:
    """The run in `folder` on 2 ranks through run_train.sh, as a user runs it: when `step` is logged, `signum` goes to
    every process of the job (as SLURM sends it); its stderr and exit code in folder/signalled.json."""
    env = {**os.environ, "NGPU": "2", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([str(REPO / "run_train.sh"), *FLAGS, "--job.dump_folder", str(folder / "run")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    for line in proc.stdout:
        if f"step {step}/8" in line:
            os.killpg(proc.pid, signum)
            break
    _, err = proc.communicate(timeout=900)
    (folder / "signalled.json").write_text(json.dumps({"returncode": proc.returncode, "stderr": err}))


def after_signal(folder: Path) -> tuple[int, str]:
    """The signalled run's exit code and stderr."""
    stopped = json.loads((folder / "signalled.json").read_text())
    return stopped["returncode"], stopped["stderr"]


def died_after_save(folder: Path, saved: Path, lost: str = "step-8", steps_logged: int | None = None) -> None:
    """`saved`'s dump folder copied into `folder`, as if the job had died after its save before `lost`: that
    checkpoint gone, and (`steps_logged`) the metrics of the steps after the save too, so that the relaunch's own
    steps are the ones compared."""
    run = folder / "run"
    shutil.copytree(saved / "run", run)
    shutil.rmtree(run / "checkpoint" / lost)
    if steps_logged is not None:
        metrics = run / "metrics.jsonl"
        metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()[:steps_logged]))


def relaunch(name: str, nproc: int, saved: Run, *flags: str, **died) -> Run:
    """A run on `nproc` processes of `flags`, relaunched on what `saved` left when it died after a save."""
    return register(Run(f"resume/{name}", nproc, TRAIN, flags, functools.partial(died_after_save, **died), (saved,)))


# The uninterrupted runs: 8 steps on 2 ranks and on 1, each saving at steps 4 and 8.
REF1 = register(Run("resume/ref1", 1, TRAIN, EVERY_4))
REF2 = register(Run("resume/ref2", 2, TRAIN, EVERY_4))


# Stopped by SIGTERM once step 3 is logged (run_train.sh, 2 ranks), then relaunched.
AFTER_SIGTERM = register(Run("resume/after_sigterm", 2, TRAIN, FLAGS,
                             functools.partial(signalled, step=3, signum=signal.SIGTERM)))


def test_sigterm_saves_exits_0_and_the_relaunch_equals_the_uninterrupted_run_bitwise(launches):
    folder = launches.folder_of(AFTER_SIGTERM)
    returncode, stderr = after_signal(folder)
    assert returncode == 0, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if "stopped on SIGTERM" in line]
    assert len(lines) == 1 and "saved checkpoint" in lines[0], stderr[-3000:]
    assert "Traceback" not in stderr and "error:" not in stderr
    assert "resumed from checkpoint" in logged(folder)
    assert losses(folder) == losses(launches.folder_of(REF2))  # every step, to the last bit


ON_OTHER_RANKS = {(2, 1): relaunch("ref2_on_1", 1, REF2, *EVERY_4), (1, 2): relaunch("ref1_on_2", 2, REF1, *EVERY_4)}


@pytest.mark.parametrize("saved_by, resumed_by", [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_on_another_number_of_ranks(launches, saved_by, resumed_by):
    ref = launches.folder_of(REF2 if saved_by == 2 else REF1)
    resumed = launches.folder_of(ON_OTHER_RANKS[saved_by, resumed_by])
    text = logged(resumed)
    assert "resumed from checkpoint" in text and f"saved by {saved_by} ranks, resumed by {resumed_by}" in text
    want, got = losses(ref), losses(resumed)
    assert sorted(got) == list(range(1, 9))
    # The first step after the resume: the saved weights and rows, only the forward's summation order differs
    # (measured 8e-8 relative).
    assert got[5] == pytest.approx(want[5], rel=1e-6)
    # Then AdamW turns summation noise in near-zero gradients into lr-sized updates, and the run drifts from the
    # saving one as any run on another number of ranks does: no further than the uninterrupted runs on 1 and 2 ranks
    # drift apart over the same steps (measured: resumed 2e-6 to 2.2e-5 relative, uninterrupted up to 1.2e-4). A
    # resume that lost the optimizer's moments is 2e-2 off from step 6 on (measured, one process).
    one, two = losses(launches.folder_of(REF1)), losses(launches.folder_of(REF2))
    drift = max(abs(one[step] - two[step]) / two[step] for step in range(5, 9))
    assert drift < 1e-3, drift  # the rank counts' own drift stays far below what a lost state would show
    for step in range(6, 9):
        assert abs(got[step] - want[step]) <= max(drift, 1e-6) * want[step], (step, got[step], want[step], drift)


CP2 = ("--parallelism.context_parallel_degree", "2")
SAVED_WITH_CP = register(Run("resume/cp2", 2, TRAIN, (*EVERY_4, *CP2)))
MOVED_BETWEEN_CP_AND_ONE_PROCESS = {
    True: relaunch("cp2_on_1", 1, SAVED_WITH_CP, *EVERY_4, steps_logged=4),
    False: relaunch("ref1_on_cp2", 2, REF1, *EVERY_4, *CP2, steps_logged=4),
}


@pytest.mark.parametrize("saved_with_cp", [True, False])
def test_a_checkpoint_moves_between_context_parallel_and_one_process(launches, saved_with_cp):
    """CP=2 over 2 ranks reads the rows one process reads (one data-parallel rank): saved with CP=2 and resumed
    by one process, or the reverse, the run continues the one-process run."""
    ref = launches.folder_of(REF1)
    if saved_with_cp:
        full = losses(launches.folder_of(SAVED_WITH_CP))
        for step in range(1, 9):  # CP=2 trains like one process (other summation order only)
            assert full[step] == pytest.approx(losses(ref)[step], rel=1e-5), step
    resumed = launches.folder_of(MOVED_BETWEEN_CP_AND_ONE_PROCESS[saved_with_cp])
    assert "resumed from checkpoint" in logged(resumed)
    got, want = losses(resumed), losses(ref)
    assert sorted(got) == list(range(1, 9))
    for step in range(5, 9):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


EP2 = ("--parallelism.expert_parallel_degree", "2")
SAVED_WITH_EP = register(Run("resume/ep2", 2, TRAIN, (*EVERY_4, *EP2)))
MOVED_BETWEEN_EP_AND_FSDP = {
    True: relaunch("ep2_on_fsdp2", 2, SAVED_WITH_EP, *EVERY_4, steps_logged=4),
    False: relaunch("ref2_on_ep2", 2, REF2, *EVERY_4, *EP2, steps_logged=4),
}


@pytest.mark.parametrize("saved_with_ep", [True, False])
def test_a_checkpoint_moves_between_expert_parallel_and_fsdp(launches, saved_with_ep):
    """EP=2 over 2 ranks (each rank holds half of every layer's experts) trains like FSDP=2 (each rank holds half
    of every expert's rows): a checkpoint of one resumes in the other. The first resumed step is bitwise the
    step the saving run took, so weights, optimizer state and data position came back whole."""
    saved = launches.folder_of(SAVED_WITH_EP if saved_with_ep else REF2)
    if saved_with_ep:
        for step, loss in losses(launches.folder_of(REF2)).items():  # EP changes no number here (measured: bitwise)
            assert losses(saved)[step] == pytest.approx(loss, rel=1e-6), step
        # The offline converter reads the EP-sharded experts of the DCP step into the end-of-run export's bytes.
        converted = saved / "converted"
        assert convert_main([str(saved / "run" / "checkpoint" / "step-8"), str(converted)]) == 0
        for exported in (saved / "run" / "hf").glob("*.safetensors"):
            assert (converted / exported.name).read_bytes() == exported.read_bytes(), exported.name
    resumed = launches.folder_of(MOVED_BETWEEN_EP_AND_FSDP[saved_with_ep])
    assert "resumed from checkpoint" in logged(resumed)
    got, want = losses(resumed), losses(saved)
    assert sorted(got) == list(range(1, 9))
    assert got[5] == want[5]
    for step in range(6, 9):  # measured: bitwise up to step 7, then 1e-7 (other gradient summation order)
        assert got[step] == pytest.approx(want[step], rel=1e-6), step


def corrupt_on_rank_1(folder: Path, saved: Path) -> None:
    """`saved`'s dump folder copied as its run left it, with 64 bytes flipped in the middle of the file rank 1 wrote
    for step 8 (the file only rank 1 verifies)."""
    shutil.copytree(saved / "run", folder / "run")
    data = folder / "run" / "checkpoint" / "step-8" / "__1_0.distcp"
    flip_bytes(data, data.stat().st_size // 2)


CORRUPT_ON_RANK_1 = register(Run("resume/corrupt_on_rank_1", 2, TRAIN, EVERY_4, corrupt_on_rank_1, (REF2,)))


def test_a_checkpoint_that_fails_verification_on_one_rank_is_skipped_by_both(launches):
    """Each rank checks its share of the files; rank 1's finding is both ranks' decision: they resume step 4 together
    (one rank on step 8 would hang or mix states), step 8 is moved aside, and the run ends as the uninterrupted one."""
    folder = launches.folder_of(CORRUPT_ON_RANK_1)
    text = logged(folder)
    assert "checkpoint step-8 failed verification: __1_0.distcp digest" in text and "resuming from step-4" in text
    assert "checkpoint/step-4 (step 4)" in text
    assert losses(folder) == losses(launches.folder_of(REF2))  # steps 5-8 trained again: the same bits
    assert [p.name for p in (folder / "run" / "checkpoint").glob("abandoned-*/*")] == ["step-8"]


FSDP_VOCAB = ("--parallelism.vocab_parallel", "never")
SAVED_AS_FSDP_UNITS = register(Run("resume/fsdp_vocab", 2, TRAIN, (*EVERY_4, *FSDP_VOCAB)))
MOVED_BETWEEN_VOCAB_PARALLEL_AND_FSDP_UNITS = {
    # the 2-rank reference: 2 ranks x 128 tokens <= 512 vocabulary rows, "auto" takes it vocabulary-parallel
    True: relaunch("ref2_as_fsdp_units", 2, REF2, *EVERY_4, *FSDP_VOCAB, steps_logged=4),
    False: relaunch("fsdp_vocab_as_vocab_parallel", 2, SAVED_AS_FSDP_UNITS, *EVERY_4, steps_logged=4),
}


@pytest.mark.parametrize("saved_vocab_parallel", [True, False])
def test_a_checkpoint_moves_between_vocab_parallel_and_fsdp_units(launches, saved_vocab_parallel):
    """The vocabulary-parallel embedding and lm_head keep FSDP's layout of their weights: a checkpoint of either way
    resumes in the other, and the run continues the saving run's losses."""
    saved = launches.folder_of(REF2 if saved_vocab_parallel else SAVED_AS_FSDP_UNITS)
    if not saved_vocab_parallel:
        # Other summation order only: in float64 the two layouts' losses agree to 2e-16 at every step. In fp32 AdamW
        # turns summation noise in near-zero gradients into lr-sized updates (its first ones are ~lr * sign(grad)),
        # and two summation orders of one run drift apart over the 8 steps: measured up to 1.8e-5 relative here
        # (step 7), 2.8e-5 between one process and 2 ranks (test_a_checkpoint_resumes_on_another_number_of_ranks's
        # runs, step 8). A wrong vocabulary slice is off by orders of magnitude more.
        for step, loss in losses(launches.folder_of(REF2)).items():
            assert losses(saved)[step] == pytest.approx(loss, rel=5e-5), step
    resumed = launches.folder_of(MOVED_BETWEEN_VOCAB_PARALLEL_AND_FSDP_UNITS[saved_vocab_parallel])
    assert "resumed from checkpoint" in logged(resumed)
    got, want = losses(resumed), losses(saved)
    assert sorted(got) == list(range(1, 9))
    for step in range(5, 9):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


def write_tied_config(folder: Path, *saved: Path) -> None:
    from models.qwen35_moe import get_flavor

    args = dataclasses.replace(get_flavor("debugmodel"), tie_word_embeddings=True)
    (folder / "config.json").write_text(json.dumps(args.to_hf_config()))


def tied_relaunch(folder: Path, saved: Path) -> None:
    write_tied_config(folder)
    died_after_save(folder, saved, steps_logged=4)


TIED = ("--model.hf_config", "{folder}/config.json")
TIED_SAVED = register(Run("resume/tied", 2, TRAIN, (*EVERY_4, *TIED), write_tied_config))
TIED_RESUMED = register(Run("resume/tied_resumed", 2, TRAIN, (*EVERY_4, *TIED), tied_relaunch, (TIED_SAVED,)))


def test_a_tied_model_resumes_on_two_ranks_bitwise_and_exports_one_matrix(launches):
    """tie_word_embeddings through FSDP's checkpoint: the shared weight (one parameter, in the root unit) saves and
    resumes, the resumed steps equal the uninterrupted run's bit for bit, and the export writes the one matrix
    (no lm_head.weight), which loads back tied."""
    from safetensors import safe_open

    from models.qwen35_moe import from_pretrained

    resumed = launches.folder_of(TIED_RESUMED)
    assert "resumed from checkpoint" in logged(resumed)
    assert losses(resumed) == losses(launches.folder_of(TIED_SAVED))
    hf = resumed / "run" / "hf"
    keys = {key for path in hf.glob("*.safetensors") for key in safe_open(path, "pt").keys()}
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    model = from_pretrained(hf)
    assert model.lm_head.weight is model.embed_tokens.weight


ASYNC = register(Run("resume/async", 2, TRAIN, (*EVERY_4, "--checkpoint.async_mode", "async")))


def test_async_saves_on_two_ranks_change_nothing_and_complete(launches):
    folder = launches.folder_of(ASYNC)
    assert losses(folder) == losses(launches.folder_of(REF2))
    assert sorted(p.parent.name for p in (folder / "run" / "checkpoint").glob("step-*/COMPLETE")) == ["step-4",
                                                                                                     "step-8"]


INTERRUPTED = started_processes("resume/interrupted",  # run_train.sh, 2 ranks, Ctrl-C once step 2 is logged
                                functools.partial(signalled, step=2, signum=signal.SIGINT))


def test_ctrl_c_saves_and_stops_with_one_line(launches):
    folder = launches.folder_of(INTERRUPTED)
    returncode, stderr = after_signal(folder)
    assert returncode == 130, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if "interrupted at step" in line]
    assert len(lines) == 1 and "saved checkpoint" in lines[0]
    assert "Traceback" not in stderr
    assert any((folder / "run" / "checkpoint").glob("step-*/COMPLETE"))


# FSDP=2 x CP=2 with EP=2 over 4 ranks (issue 12's layout, on CPU), 4 steps of 2 rows, saved at step 2.
COMPOSED = ("--parallelism.data_parallel_shard_degree", "2", "--parallelism.context_parallel_degree", "2", *EP2)
SHORT = (*FLAGS, "--training.steps", "4", "--checkpoint.interval", "2", "--training.global_batch_size", "2")
COMPOSED_SAVED = register(Run("resume/composed", 4, TRAIN, (*SHORT, "--training.local_batch_size", "1", *COMPOSED)))


def composed_relaunch(folder: Path, saved: Path) -> None:
    died_after_save(folder, saved, lost="step-4", steps_logged=2)
    shutil.rmtree(folder / "run" / "hf")


COMPOSED_RESUMED = {ngpu: register(Run(f"resume/composed_on_{ngpu}", ngpu, TRAIN,
                                       (*SHORT, "--training.local_batch_size", str(2 // ngpu)), composed_relaunch,
                                       (COMPOSED_SAVED,)))
                    for ngpu in (2, 1)}


@pytest.mark.parametrize("ngpu", [2, 1])
def test_a_four_rank_composed_checkpoint_resumes_on_two_ranks_and_on_one(launches, ngpu):
    """FSDP=2 x CP=2 with EP=2 over 4 ranks (issue 12's layout, on CPU), saved at step 2: resumed by plain FSDP
    over 2 ranks and by one process, each continues the 4-rank run (same global batch: 2 rows per step)."""
    saved = launches.folder_of(COMPOSED_SAVED)
    resumed = launches.folder_of(COMPOSED_RESUMED[ngpu])
    text = logged(resumed)
    assert "resumed from checkpoint" in text and f"saved by 4 ranks, resumed by {ngpu}" in text
    want, got = losses(saved), losses(resumed)
    for step in (3, 4):  # other summation order (CP's head-parallel GDN, EP's expert sums): ~1e-7 relative
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    # The export of the resumed run holds the same tensors as the 4-rank run's (same keys; values within fp32
    # summation-order noise after two more steps).
    assert sorted(p.name for p in (resumed / "run" / "hf").iterdir()) == sorted(
        p.name for p in (saved / "run" / "hf").iterdir())
