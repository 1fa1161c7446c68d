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
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from models.qwen35_moe import attention, get_flavor, moe
from parallel.parallelize import parallelize_qwen35_moe
from tests.builders import compile_blocks, experts_in_one_graph, fp32_grad_tolerance, initialized_model
from tests.compiled import (
    BATCH,
    SEQ,
    assert_compiled_matches_eager,
    batch_ids,
    compiled_without_inductor,
    loss_and_grads,
    packed_positions,
    training_loss,
    varlen_stand_in,
)

# An unpacked batch, then packed ones with every document count and longest document different.
LAYOUTS = [None, [[40, 56], [96]], [[10, 20, 66], [30, 30, 36]], [[96], [5, 91]], [[1, 94, 1], [70, 26]],
           [[33, 33, 30], [20, 20, 20, 20, 16]]]
WARMUP = 3  # the unpacked path, a packed one, and the recompile that makes cu_seqlens' size dynamic


@pytest.fixture(autouse=True)
def aot_eager_backend():
    """AOT's eager backend (tests/compiled.py): the frames, graph breaks, recompiles and traced checkpoints asked
    about here are dynamo's and AOT autograd's; inductor's C++ kernels would cost ~75 s of a cold cache on CPU, where
    no user compiles. Inductor's GPU kernels, the product's path, are tested in tests/gpu."""
    with compiled_without_inductor():
        yield


@pytest.mark.parametrize("ac_mode", ["none", "full"])
def test_compiled_blocks_match_eager_and_compile_once(monkeypatch, ac_mode):
    """Also under full AC, compiled in two halves with the MoE half's checkpoint traced (the experts as one graph,
    as on the GPU): the recompute must pick the forward's graphs whatever the layout."""
    monkeypatch.setattr(attention, "_flash_applies", lambda q: True)
    monkeypatch.setattr(attention, "_varlen_attn", lambda: (varlen_stand_in, True))
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
        ids = torch.randint(0, 512, (BATCH, SEQ), generator=g)
        positions = None if documents is None else packed_positions(documents)
        assert_compiled_matches_eager(loss_and_grads(compiled, ids, positions), loss_and_grads(eager, ids, positions),
                                      documents)
    assert counters["frames"]["ok"] == compiles_after_warmup, "new document layouts recompiled the blocks"
    torch._dynamo.reset()


def _compiled_graph_calls(model, ids) -> int:
    """How many times compiled graphs run, forward and backward, in one step of `model` (AOT autograd's function
    around each graph pair, whatever the backend)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss_and_grads(model, ids, None)
    return sum(e.name in ("CompiledFunction", "CompiledFunctionBackward") for e in prof.events())


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
    ids = batch_ids(5)
    loss, grads = loss_and_grads(eager, ids, None)
    for _ in range(2):  # compiles, then runs the compiled graphs
        loss_c, grads_c = loss_and_grads(checkpointed, ids, None)
        loss_and_grads(plain, ids, None)
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
    loss = training_loss(model(ids), ids)
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
    ids = batch_ids(6)
    loss, grads = loss_and_grads(eager, ids, None)
    for _ in range(2):
        loss_c, grads_c = loss_and_grads(checkpointed, ids, None)
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
