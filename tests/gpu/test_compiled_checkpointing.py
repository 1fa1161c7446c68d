"""Full activation checkpointing of compiled blocks on the GPU (parallel/activation_checkpointing.py): each block's
MoE half is traced by dynamo with its checkpoint, so its recompute is part of the compiled backward. Against the
same compiled model without checkpointing: the same loss and gradients; the backward runs the experts' two grouped
GEMMs again, but not the routing (kept) nor the weighted combine of the experts' outputs (the backward does not
read its output), which an eager recompute of the whole block runs again."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from models.qwen35_moe.gated_delta_rule import enable_fla_hopper_backward
from parallel.parallelize import parallelize_qwen35_moe
from tests.gpu.test_model_cuda import ARGS, PACKED_POSITIONS, _batch, _rel, build_reference_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _step(model, ids, positions):
    """Loss, gradients, and what the backward ran: grouped GEMMs, top-k / sort ops, combine kernels."""
    model.zero_grad()
    out = model(ids, positions)
    loss = F.cross_entropy(out.logits.flatten(0, 1).float(), ids.roll(-1, dims=1).flatten()) + 0.01 * out.aux_loss
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        loss.backward()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    # `_weighted_row_sum` is the combine's forward kernel and, without weights, the token gather's backward.
    ran = (sum(n == "aten::_grouped_mm" for n in names), sum(n in ("aten::topk", "aten::sort") for n in names),
           sum(n.startswith("_weighted_row_sum") and "backward" not in n for n in names))
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, ran


def test_compiled_full_checkpointing_traces_the_moe_half_and_matches_no_checkpointing():
    torch._dynamo.reset()
    enable_fla_hopper_backward(ARGS.linear_num_key_heads, ARGS.linear_num_value_heads,
                               ARGS.linear_key_head_dim, ARGS.linear_value_head_dim, "cuda")
    ref = build_reference_model().to("cuda")
    ids, positions = _batch(0).cuda(), PACKED_POSITIONS.cuda()
    runs = {}
    for mode in ("none", "full"):
        model = parallelize_qwen35_moe(copy.deepcopy(ref), None, param_dtype=torch.bfloat16,
                                       reduce_dtype=torch.float32, ac_mode=mode, compile=True)
        for _ in range(2):  # compiles, then runs the compiled graphs
            runs[mode] = _step(model, ids, positions)
        if mode == "full":
            assert [layer.moe_half_traced for layer in model.layers.values()] == [True] * ARGS.num_hidden_layers
    (loss, grads, ran), (loss_ac, grads_ac, ran_ac) = runs["none"], runs["full"]
    layers = ARGS.num_hidden_layers
    # Per layer: the two grouped GEMMs' input and weight gradients (4), no routing op, the gather's backward.
    assert ran[:2] == (4 * layers, 0) and ran[2] > 0
    # + both grouped GEMMs again; the routing and the combine are not rerun (an eager recompute of the whole block
    # would run one top-k, one sort and one combine per layer).
    assert ran_ac == (6 * layers, 0, ran[2])
    # The checkpointed block is compiled as other graphs (two halves, the projection between them eager), whose
    # fusions round differently in bf16 (the loss 1.8e-4 apart on an H200); a recompute that read a wrong tensor
    # would be off by far more. Each parameter's gradient to 2% (relative error of the whole tensor).
    assert loss_ac == pytest.approx(loss, rel=1e-3)
    errors = {name: _rel(grads_ac[name], grad) for name, grad in grads.items()}
    print("largest gradient errors:", sorted(errors.items(), key=lambda item: -item[1])[:3])
    assert max(errors.values()) < 2e-2, errors
    torch._dynamo.reset()
