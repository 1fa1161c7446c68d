"""Training the MTP layer: its loss is the token mean of the x_{t+2} cross entropy over the valid targets of the
global batch (never across a document, masked targets left out), the same in float64 on one process, FSDP=2, CP=2
(the shifts crossing zigzag chunks and ranks), EP=2, FSDP=2 with full activation checkpointing and FSDP=2 with the
lm_head an FSDP unit, and the same as each document run alone with the targets listed by hand
(tests/distributed/mtp_worker.py)."""

import pytest

from tests.distributed.launch import register_layouts
from tests.distributed.trainer_runs import assert_same_grads, saved_result

LAYOUTS = {
    "fsdp2": (2, ()),
    "cp2": (2, ("--parallelism.context_parallel_degree", "2")),
    "ep2": (2, ("--parallelism.expert_parallel_degree", "2")),
    "fsdp2_full_ac": (2, ("--activation_checkpoint.mode", "full")),
    # the 2-rank layouts above go vocabulary-parallel ("auto"); here the lm_head is an FSDP unit
    "fsdp2_lm_head_unit": (2, ("--parallelism.vocab_parallel", "never")),
}
SINGLE, RUNS = register_layouts("mtp", "tests.distributed.mtp_worker:step", LAYOUTS)


def test_mtp_loss_is_the_token_mean_over_the_x_t2_targets_of_each_document_alone(launches):
    ref = saved_result(launches, SINGLE)
    loss, targets = ref["reference"]
    # 4 rows x 4 documents, a third of the labels masked: well below every position, well above none
    assert 0.4 * 4 * 64 < targets < 0.65 * 4 * 64
    # The model's cross entropy runs in fp32 (the per-token loss kernel), the reference in float64 (as test_sft:
    # measured ~1e-8 relative); a target across a document boundary or a masked one counted moves it by > 1e-3.
    assert ref["out"]["mtp_loss"] == pytest.approx(loss, rel=1e-6)
    mtp_grads = [g for name, g in ref["grads"].items() if name.startswith("mtp.")]
    assert mtp_grads and all(g.norm() > 0 for g in mtp_grads)  # every MTP weight is trained


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mtp_step_matches_single_process(launches, name):
    ref, got = saved_result(launches, SINGLE), saved_result(launches, RUNS[name])
    for key in ("loss", "mtp_loss", "aux_loss", "grad_norm"):
        assert got["out"][key] == pytest.approx(ref["out"][key], rel=1e-9), key
    assert got["validation"]["val_mtp_accept"] == ref["validation"]["val_mtp_accept"]  # a ratio of counts
    for key in ("val_loss", "val_mtp_loss"):
        assert got["validation"][key] == pytest.approx(ref["validation"][key], rel=1e-9), key
    assert_same_grads(got, ref)
