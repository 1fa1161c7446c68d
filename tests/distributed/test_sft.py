"""Chat fine-tuning's loss is the token mean over the assistant's tokens of the whole global batch: the same, in
float64, on one process, FSDP=2, CP=2 (targets split over the zigzag chunks) and EP=2, and the same as each
conversation run alone (unpacked) with the cross entropy computed outside the model (tests/distributed/sft_worker.py)."""

import pytest

from tests.distributed.launch import register_layouts
from tests.distributed.trainer_runs import assert_same_grads, saved_result

LAYOUTS = {
    "fsdp2": (2, ()),
    "cp2": (2, ("--parallelism.context_parallel_degree", "2")),
    "ep2": (2, ("--parallelism.expert_parallel_degree", "2")),
}
SINGLE, RUNS = register_layouts("sft", "tests.distributed.sft_worker:step", LAYOUTS)


def test_packed_loss_is_the_token_mean_over_the_targets_of_the_conversations_run_alone(launches):
    ref = saved_result(launches, SINGLE)
    unpacked_loss, unpacked_targets = ref["unpacked"]
    assert unpacked_targets == ref["targets"]  # every target of the packed rows, counted once
    # Only assistant tokens are targets: a fraction of the rows (the prompts and the padding are not).
    assert 0 < ref["targets"] < 0.8 * ref["row_tokens"]
    # The model's cross entropy runs in fp32 even in a float64 model (the per-token loss kernel), the reference in
    # float64: they differ by fp32 rounding (measured 3.7e-8 relative). Each row's conversations run as one document
    # (attending across conversations) moves even this freshly initialised model's loss by 1.4e-5; a prompt token
    # counted as a target moves it by far more.
    assert ref["out"]["loss"] == pytest.approx(unpacked_loss, rel=1e-6)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_chat_step_matches_single_process(launches, name):
    ref, got = saved_result(launches, SINGLE), saved_result(launches, RUNS[name])
    assert got["targets"] == ref["targets"]
    assert got["validation"]["val_loss"] == pytest.approx(ref["validation"]["val_loss"], rel=1e-6)
    for key in ("loss", "aux_loss", "grad_norm"):
        assert got["out"][key] == pytest.approx(ref["out"][key], rel=1e-5), key
    assert_same_grads(got, ref)
