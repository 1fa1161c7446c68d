"""The gradient that reaches a collective's backward is contiguous (parallel/collectives.py), for the exchanges of
context and expert parallelism with local_batch_size > 1. torch 2.11's C++ collective backwards reject a strided
gradient (`Expected input.is_contiguous()`), so CP with 2 rows per rank crashed on GPU; torch 2.13 accepts it,
hence this test inspects the gradients themselves rather than waiting for the crash."""

import pytest
import torch

import parallel.collectives as collectives
from parallel.context_parallel import CPContext
from parallel.expert_parallel import ExpertParallel


@pytest.fixture
def seen(monkeypatch):
    """Wrap the raw collectives: record, per call, whether the gradient of its output arrived contiguous."""
    record = []

    def watched(raw):
        def call(*args, **kwargs):
            out = raw(*args, **kwargs)
            out.register_hook(lambda g: record.append((raw.__name__, g.is_contiguous())))
            return out
        return call

    for name in ("_all_gather", "_reduce_scatter", "_all_to_all"):
        monkeypatch.setattr(collectives, name, watched(getattr(collectives, name)))
    return record


def test_context_parallel_exchanges_hand_contiguous_gradients_to_the_collectives(one_rank_mesh, seen):
    cp = CPContext(one_rank_mesh)
    x = torch.randn(2, 8, 4, requires_grad=True)  # (B=2, S, D): movedim(1, 0) of it is strided
    rows = cp.gather_sequence(x)
    out = cp.scatter_sequence(rows * torch.arange(1.0, 5.0))
    (out * torch.randn(2, 8, 4)).sum().backward()  # a contiguous gradient of the movedim view: strided below it
    assert len(seen) == 2 and all(contiguous for _, contiguous in seen), seen
    torch.testing.assert_close(out, x * torch.arange(1.0, 5.0))  # one rank: gather, then scatter = identity


def test_expert_exchange_hands_contiguous_gradients_to_the_collectives(one_rank_mesh, seen):
    x = torch.randn(6, 4, requires_grad=True)
    counts = torch.tensor([2, 0, 4])
    out = ExpertParallel(one_rank_mesh).exchange(x, counts, lambda tokens, local_counts: tokens * 2)
    out.t().sum(0).sum().backward()  # a transposed consumer: its gradient is strided
    assert len(seen) == 2 and all(contiguous for _, contiguous in seen), seen
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
