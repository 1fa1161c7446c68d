"""Full activation checkpointing of compiled blocks on the GPU (parallel/activation_checkpointing.py): each block's
MoE half is traced by dynamo with its checkpoint, so its recompute is part of the compiled backward. Against the
same halves checkpointed eagerly around their compiled graphs (what a half with a graph break gets): the same loss
and gradients, and a backward that runs the experts' two grouped GEMMs again but not the routing (kept) nor the
weighted combine of the experts' outputs (no backward reads its output).

The reference is the same compiled graphs rather than the uncheckpointed model: split into halves, the block is
compiled as other graphs, whose bf16 rounding differs (the loss 3.8e-4 apart on an H200), and in this small model
some gradients are sums that cancel (the SSM gate's A_log and dt_bias): compiled and eager without any
checkpointing differ there by 230% in bf16."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from models.qwen35_moe.kernels.fla_hopper_guard import enable_fla_hopper_backward
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


def test_compiled_full_checkpointing_traces_the_moe_half():
    torch._dynamo.reset()
    enable_fla_hopper_backward(ARGS.linear_num_key_heads, ARGS.linear_num_value_heads,
                               ARGS.linear_key_head_dim, ARGS.linear_value_head_dim, "cuda")
    ref = build_reference_model().to("cuda")
    ids, positions = _batch(0).cuda(), PACKED_POSITIONS.cuda()
    runs, layers = {}, ARGS.num_hidden_layers
    for mode, traced in (("none", None), ("full", True), ("full", False)):
        model = parallelize_qwen35_moe(copy.deepcopy(ref), None, param_dtype=torch.bfloat16,
                                       reduce_dtype=torch.float32, ac_mode=mode, compile=True)
        if traced is False:  # as where the MoE half breaks the graph
            for layer in model.layers.values():
                layer.runner.moe_half_traced = False
        for _ in range(2):  # compiles, then runs the compiled graphs
            runs[mode, traced] = _step(model, ids, positions)
        if traced:
            assert [layer.runner.moe_half_traced for layer in model.layers.values()] == [True] * layers
    (loss, grads, ran), (loss_t, grads_t, ran_t), (loss_e, grads_e, ran_e) = runs.values()
    # Per layer: the two grouped GEMMs' input and weight gradients (4), no routing op, the gather's backward.
    assert ran[:2] == (4 * layers, 0) and ran[2] > 0
    # Both recomputes run the grouped GEMMs again; the eager one also the top-k and sort, and the combine.
    assert ran_t == (6 * layers, 0, ran[2])
    assert ran_e == (6 * layers, 2 * layers, 2 * ran[2])
    # The same forward graphs; the backward's fusions differ, which rounds differently in bf16 (1.4e-3 apart for
    # the embedding's gradient on an H200). Each gradient no further from the eager recompute's than that is from
    # the uncheckpointed model's (which the halves' other forward graphs move by ~0.1), or than 1%: a recompute
    # from a wrong tensor would be off by the gradient's own size.
    assert loss_t == loss_e and loss_t == pytest.approx(loss, rel=1e-3)
    errors = {name: (_rel(grads_t[name], grad), _rel(grad, grads[name])) for name, grad in grads_e.items()}
    print("gradient errors, traced vs eager recompute (vs uncheckpointed):",
          sorted(errors.items(), key=lambda item: -item[1][0])[:4])
    for name, (error, split_error) in errors.items():
        assert error <= max(split_error, 1e-2), (name, error, split_error)
    torch._dynamo.reset()
