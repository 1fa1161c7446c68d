"""A training forward and backward on CUDA makes the host wait for the GPU nowhere in our code: with the batch's
document layout derived on the host (as the trainer does), torch's sync debug mode reports every synchronizing
call (`.item()`, data-dependent output sizes like bincount or nonzero, blocking copies) in the model, the MoE
dispatch, the varlen attention, FLA's kernels and the chunked cross entropy. (Left to itself, FLA 0.6 uploads
the chunk index it derives from the host `cu_seqlens` with a blocking copy, once per step: we hand it the index,
built on the host and copied from pinned memory, `models/qwen35_moe/kernels/fla_varlen.py`.)"""

from __future__ import annotations

import warnings

import pytest
import torch

from models.qwen35_moe.documents import document_layout
from tests.gpu.test_model_cuda import ARGS, PACKED_POSITIONS, _batch, build_reference_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_forward_and_backward_make_no_host_sync():
    from models.qwen35_moe.kernels.fla_hopper_guard import enable_fla_hopper_backward

    enable_fla_hopper_backward(ARGS.linear_num_key_heads, ARGS.linear_num_value_heads,
                               ARGS.linear_key_head_dim, ARGS.linear_value_head_dim, "cuda")
    model = build_reference_model().to("cuda", torch.bfloat16)
    ids, labels = _batch(7).cuda(), _batch(8).cuda()

    def step():
        layout = document_layout(PACKED_POSITIONS, *PACKED_POSITIONS.shape, torch.device("cpu")).to("cuda")
        scale = 2 / (labels != -100).sum().float()  # the trainer's: the loss's gradient known in forward
        out = model(ids, labels=labels, layout=layout, loss_chunk_tokens=200, ce_weight=scale)
        (out.ce_sum + out.aux_loss).backward()  # checked on the device by the loss's backward: no sync

    step()  # compiles and autotunes the kernels (autotuning times them: that waits, once)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)]
    assert not syncs, f"host syncs: {syncs}"


def test_a_steps_metrics_are_read_without_waiting_for_the_work_queued_after_them():
    """The trainer reads step t's metrics once step t + 1 is queued (harness/trainer.py): the read must wait for
    step t's kernels only, and the step's time on the device (metrics.DeviceClock) is its own. A 0.5 s kernel
    queued after the values stands in for the next step."""
    import time

    from harness.metrics import DeviceClock
    from harness.objective import StepLosses
    from harness.step_metrics import NAMES, StepValues

    clock = DeviceClock(torch.device("cuda"))
    torch.cuda.synchronize()
    began = clock.now()
    scalars = torch.arange(4.0, device="cuda") * 2
    # one layer of 4 experts, 3 + 1 assignments over an even 1: the busiest expert 3x, the busier of 2 EP ranks 2x
    counts = torch.tensor([[3.0, 1.0, 0.0, 0.0]], device="cuda")
    losses = StepLosses(scalars[0], scalars[1], scalars[2], counts)
    pending = StepValues(1, losses, scalars[3], 2, clock, NAMES)
    torch.cuda._sleep(1_000_000_000)  # the "next step": 10^9 GPU cycles, >= 0.5 s at H100/H200 clocks (<= 2 GHz)
    start = time.perf_counter()
    read = pending.read()
    waited = time.perf_counter() - start
    step_seconds = clock.seconds(began, pending.ended)
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert read == dict(zip(NAMES, [0.0, 2.0, 4.0, 6.0, 3.0, 2.0]))
    assert still_busy and waited < 0.1, (waited, still_busy)
    assert step_seconds < 0.1 <= clock.seconds(began, clock.now()), step_seconds  # the next step's time is not its
