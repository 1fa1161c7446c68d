"""compile.enable: the compiled blocks compute what the eager ones do, and a run compiles once, whatever documents
its batches pack.

Packed batches differ in their document count (the size of cu_seqlens) and longest document (a Python int the
flash kernel takes). Dynamo makes a changed size dynamic after one recompile; a Python int or a host loop over the
documents traced into the graph would instead recompile at every new layout, and after 8 (dynamo's recompile
limit) the block silently runs eagerly for the rest of the run. The flash varlen path is exercised on CPU with a
varlen stand-in (attention per document with SDPA), so the ints it receives are those of the CUDA path.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch._dynamo.utils import counters

from models.qwen35_moe import attention, get_flavor, moe
from parallel.parallelize import parallelize_qwen35_moe
from tests.builders import compile_blocks, experts_in_one_graph, fp32_grad_tolerance, initialized_model

SEQ = 96


def _varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, window_size, enable_gqa=False):
    """torch's varlen_attn for equal query and key segments, per segment with SDPA; checks the ints it is given."""
    assert isinstance(max_q, int) and isinstance(max_k, int), (type(max_q), type(max_k))
    bounds = cu_q.tolist()
    assert torch.equal(cu_q, cu_k) and window_size == (-1, 0)
    assert max_q == max_k == max(b - a for a, b in zip(bounds, bounds[1:]))
    out = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                          enable_gqa=enable_gqa).transpose(0, 1)
           for a, b in zip(bounds, bounds[1:])]
    return torch.cat(out)


def _positions(documents: list[list[int]]) -> torch.Tensor:
    """(B, SEQ) position ids of rows packing documents of the given lengths."""
    rows = [torch.cat([torch.arange(n) for n in row]) for row in documents]
    assert all(len(r) == SEQ for r in rows)
    return torch.stack(rows)


# An unpacked batch, then packed ones with every document count and longest document different.
LAYOUTS = [None, [[40, 56], [96]], [[10, 20, 66], [30, 30, 36]], [[96], [5, 91]], [[1, 94, 1], [70, 26]],
           [[33, 33, 30], [20, 20, 20, 20, 16]]]
WARMUP = 3  # the unpacked path, a packed one, and the recompile that makes cu_seqlens' size dynamic


def _step(model, ids, positions, **inputs):
    """One forward and backward (`inputs`: more of the model's arguments, e.g. a layout); the loss and gradients."""
    out = model(ids, positions, **inputs)
    loss = F.cross_entropy(out.logits.flatten(0, 1), ids.roll(-1, dims=1).flatten()) + 0.01 * out.aux_loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return loss.item(), grads


def assert_compiled_matches_eager(compiled: tuple, eager: tuple, what) -> None:
    """(loss, gradients) of a compiled step against the eager step's: fp32 on CPU, where compiled kernels fuse and
    sum in other orders than eager ops."""
    (loss_c, grads_c), (loss, grads) = compiled, eager
    assert loss_c == pytest.approx(loss, rel=1e-6), what
    for name, grad in grads.items():
        tol = fp32_grad_tolerance(name)
        # An element's summation noise follows the magnitudes summed into it, not its own value, so the absolute
        # floor grows with the tensor's largest element: on an AVX2 host the embedding's gradient differed by
        # 1.25e-7 at a near-zero element (max |grad| 0.11), eager and compiled each 1.6e-7 from float64.
        atol = tol * max(1e-2, grad.abs().max().item())
        torch.testing.assert_close(grads_c[name], grad, rtol=tol, atol=atol, msg=f"{name} {what}")


@pytest.mark.parametrize("ac_mode", ["none", "full"])
def test_compiled_blocks_match_eager_and_compile_once(monkeypatch, ac_mode):
    """Also under full AC, compiled in two halves with the MoE half's checkpoint traced (the experts as one graph,
    as on the GPU): the recompute must pick the forward's graphs whatever the layout."""
    monkeypatch.setattr(attention, "_flash_applies", lambda q: True)
    monkeypatch.setattr(attention, "_varlen_attn", lambda: (_varlen_stand_in, True))
    torch._dynamo.reset()
    eager = initialized_model(get_flavor("debugmodel"))
    compiled = copy.deepcopy(eager)
    if ac_mode == "none":
        compile_blocks(compiled)
    else:
        monkeypatch.setattr(moe.RoutedExperts, "forward", experts_in_one_graph)
        parallelize_qwen35_moe(compiled, None, param_dtype=torch.float32, reduce_dtype=torch.float32,
                               ac_mode=ac_mode, compile=True)
    g = torch.Generator().manual_seed(3)
    compiles_after_warmup = None
    for i, documents in enumerate(LAYOUTS):
        if i == WARMUP:
            compiles_after_warmup = counters["frames"]["ok"]
            assert compiles_after_warmup > 0  # the blocks did compile
        ids = torch.randint(0, 512, (2, SEQ), generator=g)
        positions = None if documents is None else _positions(documents)
        assert_compiled_matches_eager(_step(compiled, ids, positions), _step(eager, ids, positions), documents)
    assert counters["frames"]["ok"] == compiles_after_warmup, "new document layouts recompiled the blocks"
    torch._dynamo.reset()


def _compiled_graph_calls(model, ids) -> int:
    """How many times compiled graphs run, forward and backward, in one step of `model`."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(model, ids, None)
    return sum(e.name.startswith("## Call CompiledFxGraph") for e in prof.events())


@pytest.mark.parametrize("ac_mode", ["full", "selective"])
def test_checkpointed_blocks_still_run_compiled_and_match_eager(ac_mode):
    """compile.enable with activation checkpointing: each block is compiled, then checkpointed. The other way
    round dynamo must trace the checkpoint whole, which a block with graph breaks does not allow: it then ran the
    blocks eagerly, forward and recompute, with no error."""
    torch._dynamo.reset()
    eager = initialized_model(get_flavor("debugmodel"))
    plain = copy.deepcopy(eager)
    compile_blocks(plain)
    checkpointed = parallelize_qwen35_moe(copy.deepcopy(eager), None, param_dtype=torch.float32,
                                          reduce_dtype=torch.float32, ac_mode=ac_mode, compile=True)
    ids = torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(5))
    loss, grads = _step(eager, ids, None)
    for _ in range(2):  # compiles, then runs the compiled graphs
        loss_c, grads_c = _step(checkpointed, ids, None)
        _step(plain, ids, None)
    if ac_mode == "full":  # the CPU reference experts loop on the host: each MoE half's checkpoint is eager
        assert [layer.runner.moe_half_traced for layer in checkpointed.layers.values()] == [False] * len(checkpointed.layers)
    calls, calls_plain = _compiled_graph_calls(checkpointed, ids), _compiled_graph_calls(plain, ids)
    # Every graph the compiled block runs, plus the forward graphs again in the recompute.
    assert calls > calls_plain > 0, (calls, calls_plain)
    assert loss_c == pytest.approx(loss, rel=1e-6)
    for name, grad in grads.items():
        tol = fp32_grad_tolerance(name)
        torch.testing.assert_close(grads_c[name], grad, rtol=tol, atol=tol * 1e-2, msg=name)
    torch._dynamo.reset()


def _routing_ops_in_backward(model, ids) -> int:
    out = model(ids)
    loss = F.cross_entropy(out.logits.flatten(0, 1), ids.roll(-1, dims=1).flatten()) + 0.01 * out.aux_loss
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    model.zero_grad()
    return sum(e.name in ("aten::topk", "aten::sort") for e in prof.events())


def test_full_checkpointing_compiles_each_moe_half_with_its_checkpoint(monkeypatch):
    """Where the MoE half has no graph break (the GPU's experts; here a traceable stand-in), dynamo traces its
    checkpoint (parallel/activation_checkpointing.py): the recompute is part of the compiled backward and reuses
    the forward's routing. The mixer half's recompute stops inside the mixer's output projection, before its GEMM
    (the projection's input is the last tensor the backward needs). The loss and gradients are eager's."""
    monkeypatch.setattr(moe.RoutedExperts, "forward", experts_in_one_graph)
    torch._dynamo.reset()
    eager = initialized_model(get_flavor("debugmodel"))
    checkpointed = parallelize_qwen35_moe(copy.deepcopy(eager), None, param_dtype=torch.float32,
                                          reduce_dtype=torch.float32, ac_mode="full", compile=True)
    projections = {"entered": 0, "returned": 0}
    for layer in checkpointed.layers.values():
        def project(o, project=layer.mixer.project):
            projections["entered"] += 1
            out = project(o)
            projections["returned"] += 1
            return out
        monkeypatch.setattr(layer.mixer, "project", project)
    ids = torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(6))
    loss, grads = _step(eager, ids, None)
    for _ in range(2):
        loss_c, grads_c = _step(checkpointed, ids, None)
    # Each step: every layer's forward (entered, returned) and recompute (entered, stopped inside).
    assert projections == {"entered": 4 * len(eager.layers), "returned": 2 * len(eager.layers)}
    assert [layer.runner.moe_half_traced for layer in checkpointed.layers.values()] == [True] * len(checkpointed.layers)
    assert loss_c == pytest.approx(loss, rel=1e-6)
    for name, grad in grads.items():
        tol = fp32_grad_tolerance(name)
        torch.testing.assert_close(grads_c[name], grad, rtol=tol, atol=tol * 1e-2, msg=name)
    # An eager recompute runs each layer's top-k and expert sort again (the contrast: one of each per layer).
    assert _routing_ops_in_backward(checkpointed, ids) == 0
    assert _routing_ops_in_backward(parallelize_qwen35_moe(copy.deepcopy(eager), None, param_dtype=torch.float32,
                                                           reduce_dtype=torch.float32, ac_mode="full",
                                                           compile=False), ids) == 2 * len(eager.layers)
    torch._dynamo.reset()


@pytest.mark.parametrize("ac_mode", ["full", "selective"])
def test_selective_checkpointing_with_compile_warns_that_full_is_faster(caplog, ac_mode):
    from harness.config import load_config
    from harness.model_setup import build_model, build_model_args

    cfg = load_config(["--config", "train_configs/debug_model.toml", "--compile.enable", "true",
                       "--activation_checkpoint.mode", ac_mode])
    with caplog.at_level("WARNING", logger="harness.model_setup"):
        build_model(cfg, build_model_args(cfg, 0), None, torch.device("cpu"), load_hf=False)
    warned = any("selective with compile.enable" in r.getMessage() for r in caplog.records)
    assert warned == (ac_mode == "selective")
    torch._dynamo.reset()
