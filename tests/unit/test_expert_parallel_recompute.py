"""Expert parallelism under activation checkpointing: the recompute of a MoE layer reuses the forward's host split
sizes (one host sync per layer and step, not two), gives the gradients of the layer run without EP or AC, and
stops with a named error if its routing is not the forward's (one gloo rank; the multi-rank layouts with full
and selective AC are in tests/distributed/test_fsdp.py)."""

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import parallel.expert_parallel as expert_parallel
from models.qwen35_moe import Qwen35MoeArgs
from models.qwen35_moe.hooks import ParallelHooks
from models.qwen35_moe.moe import SparseMoE
from parallel.activation_checkpointing import _selective_context
from parallel.expert_parallel import ExpertParallel, shard_experts
from parallel.parallelize import DTensorSharding

ARGS = Qwen35MoeArgs(hidden_size=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8,
                     shared_expert_intermediate_size=8)


@pytest.fixture
def host_syncs(monkeypatch):
    calls = []
    real = expert_parallel.split_sizes
    monkeypatch.setattr(expert_parallel, "split_sizes", lambda *a: calls.append(1) or real(*a))
    return calls


def layers(mesh):
    torch.manual_seed(0)
    plain = SparseMoE(ARGS).double()
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(0, 0.5)
    ep = SparseMoE(ARGS).double()
    ep.load_state_dict(plain.state_dict())
    shard_experts(ep.experts, mesh)
    ep.set_parallel_hooks(ParallelHooks(expert_dispatch=lambda moe: ExpertParallel(mesh), sharding=DTensorSharding()))
    return plain, ep


def grads(layer, x, run):
    x = x.clone().requires_grad_()
    out = run(lambda t: layer(t)[0], x)
    (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    local = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad) for n, p in layer.named_parameters()}
    return out.detach(), x.grad, local


FULL = functools.partial(checkpoint, use_reentrant=False)
SELECTIVE = functools.partial(checkpoint, use_reentrant=False, context_fn=_selective_context)


@pytest.mark.parametrize("ac", [FULL, SELECTIVE], ids=["full", "selective"])
def test_the_recompute_reuses_the_forward_split_sizes_and_gives_the_plain_gradients(one_rank_mesh, host_syncs, ac):
    plain, ep = layers(one_rank_mesh)
    x = torch.randn(1, 40, ARGS.hidden_size, dtype=torch.float64)
    want = grads(plain, x, lambda f, t: f(t))
    got = grads(ep, x, ac)
    assert len(host_syncs) == 1  # the forward's; the recompute in backward made none
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)
    for name, g in want[2].items():
        torch.testing.assert_close(got[2][name], g, rtol=1e-12, atol=1e-12, msg=name)


def test_a_recompute_whose_routing_changed_stops_with_a_named_error(one_rank_mesh, host_syncs):
    _, ep = layers(one_rank_mesh)
    x = torch.randn(1, 40, ARGS.hidden_size, dtype=torch.float64, requires_grad=True)
    out = FULL(lambda t: ep(t)[0], x)
    before = ep.gate(x.detach().view(-1, ARGS.hidden_size))[2]
    with torch.no_grad():
        ep.gate.weight.neg_()  # the recompute now routes elsewhere (a stand-in for a non-deterministic kernel)
    assert not torch.equal(ep.gate(x.detach().view(-1, ARGS.hidden_size))[2], before)
    with pytest.raises(RuntimeError, match="recomputed routing differs"):
        out.sum().backward()
