"""What the project relies on inside torch (parallel/torch_internals.py): each test fails when a torch release
changes the behaviour, not only the name, the project depends on."""

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from parallel.torch_internals import function_with_own_frames, ignore_profiler_ranges_in_selective_checkpointing


def _block(x: torch.Tensor, break_graph: bool) -> torch.Tensor:
    y = x.sin()
    if break_graph:
        torch._dynamo.graph_break()
    return y.cos()


def test_a_function_with_copied_code_gets_compiled_frames_of_its_own():
    """Dynamo caches frames per code object: the copy and the original, called alike, compile separately, so the
    original's callers never run the copy's frames (the first block's, with its graph break under FSDP)."""
    torch._dynamo.reset()
    counter = CompileCounter()
    original = torch.compile(_block, backend=counter)
    copy = torch.compile(function_with_own_frames(_block, "_first_block"), backend=counter)
    x = torch.randn(4)
    copy(x, True)
    assert counter.frame_count == 2  # the graph break splits it in two frames
    copy(x, True)
    assert counter.frame_count == 2  # cached
    original(x, True)
    assert counter.frame_count == 4  # the same code's frames again, the original's own
    torch.testing.assert_close(copy(x, True), _block(x, True))
    torch._dynamo.reset()


def _recompute_opens_a_profiler_range():
    """A selectively checkpointed function that opens a profiler range in its recompute only, as FSDP2's hooks of a
    nested unit do; returns its input's gradient."""
    calls = []

    def fn(x):
        calls.append(1)
        if len(calls) > 1:  # the recompute
            with torch.profiler.record_function("hook"):
                pass
        return (x.sin() * 2).sum()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.sin.default else CheckpointPolicy.PREFER_RECOMPUTE

    x = torch.randn(8, requires_grad=True)
    checkpoint(fn, x, use_reentrant=False,
               context_fn=lambda: create_selective_checkpoint_contexts(policy)).backward()
    return x.grad


def test_selective_checkpointing_refuses_unmatched_profiler_ranges_unless_ignored(monkeypatch):
    from torch.utils import checkpoint as checkpoint_module

    # torch's own set, without the profiler ops an earlier test of this process may have added
    profiler_ops = {op for op in checkpoint_module.SAC_IGNORED_OPS if "profiler" in str(op)}
    monkeypatch.setattr(checkpoint_module, "SAC_IGNORED_OPS", set(checkpoint_module.SAC_IGNORED_OPS) - profiler_ops)
    with pytest.raises(RuntimeError, match="not found in storage"):
        _recompute_opens_a_profiler_range()
    ignore_profiler_ranges_in_selective_checkpointing()
    x_grad = _recompute_opens_a_profiler_range()
    assert x_grad is not None and torch.isfinite(x_grad).all()
