"""Worker for test_expert_parallel (a run of the shared launches, tests/distributed/launch.py): one MoE layer with
its routed experts split over the ranks (expert parallelism's dispatch, all-to-all and all-gather,
parallel/expert_parallel.py) against the whole layer run in one process on every rank's tokens, in float64, eager
and (on 2 ranks, the all-gather dispatch) compiled. Raises on any difference beyond float64 summation order."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from models.qwen35_moe import Qwen35MoeArgs
from models.qwen35_moe.hooks import ParallelHooks
from models.qwen35_moe.moe import SparseMoE
from parallel.parallelize import DTensorSharding, shard_experts_for_dispatch

ARGS = Qwen35MoeArgs(hidden_size=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8,
                     shared_expert_intermediate_size=8)
# Tokens per rank (up to 4). The all-to-all takes any numbers (here different ones); the all-gather needs the same
# number on every rank, as the trainer's fixed-size batches give it.
TOKENS = {"all_to_all": (24, 40, 17, 31), "all_gather": (29, 29, 29, 29)}


def tokens(rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(n, ARGS.hidden_size, generator=g)
    if rank == 0:  # rank 0's tokens only ever pick experts 0-3: the upper ranks' experts get nothing from it
        x[:, 4:8] = -x[:, 4:8].abs() - 1
    return x


def check_expert_parallel_layer(reference: SparseMoE, out_ref: torch.Tensor, whole_grad: torch.Tensor, xs, weights,
                                rank: int, ep: int, dispatch: str, compiled: bool) -> None:
    """This rank's share of the layer under EP against the whole layer's output and gradients (float64)."""
    ep_layer = SparseMoE(ARGS)
    ep_layer.load_state_dict(reference.state_dict())
    ep_layer.set_parallel_hooks(ParallelHooks(sharding=DTensorSharding(), expert_dispatch=shard_experts_for_dispatch(
        ep_layer, init_device_mesh("cpu", (ep,)), dispatch)))
    if compiled:
        # AOT's graphs, run eagerly: what dynamo traces of the exchange (the all-gather dispatch's collective is in
        # the graph). Inductor's code for it is the GPU's (tests/gpu/test_expert_parallel_cuda.py); its C++ kernels
        # here cost a cold cache ~55 s of a 2-core host's time for no user's path.
        ep_layer.compile(backend="aot_eager")
    x = xs[rank].clone().requires_grad_()
    out, counts, _ = ep_layer(x.unsqueeze(0))
    (out.squeeze(0) * weights[rank]).sum().backward()

    sizes = TOKENS[dispatch]
    mine = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    local = ARGS.num_experts // ep
    experts = slice(rank * local, (rank + 1) * local)
    if rank == 0:
        assert counts[4:].sum() == 0, counts  # the unbalanced case is really exercised
    close = dict(rtol=1e-12, atol=1e-12)
    what = f"{dispatch}{' compiled' if compiled else ''}: "
    torch.testing.assert_close(out.squeeze(0), out_ref.squeeze(0)[mine], **close, msg=what + "output")
    torch.testing.assert_close(x.grad, whole_grad[mine], **close, msg=what + "input gradient")
    # Local experts (a DTensor's local shard): each rank's gradient already holds every rank's tokens (through the
    # exchange's backward). Router and shared expert: replicated, each rank's gradient from its own tokens; summed
    # over the ranks.
    for name, p in ep_layer.named_parameters():
        if name.startswith("experts."):
            local_grad = p.grad.to_local()
            torch.testing.assert_close(local_grad, dict(reference.named_parameters())[name].grad[experts], **close,
                                       msg=what + name)
            continue
        grad = p.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, dict(reference.named_parameters())[name].grad, **close, msg=what + name)


def check(folder: str) -> None:
    torch.set_default_dtype(torch.float64)
    try:
        _check()
    finally:
        torch.set_default_dtype(torch.float32)


def _check() -> None:
    rank, ep = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = SparseMoE(ARGS)
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.5)
        reference.gate.weight.copy_(torch.eye(ARGS.num_experts, ARGS.hidden_size) * 4)  # expert e <- dim e
    for dispatch in ("all_to_all", "all_gather"):
        xs = [tokens(r, TOKENS[dispatch][r]) for r in range(ep)]
        weights = [torch.randn(x.shape, generator=torch.Generator().manual_seed(20 + r)) for r, x in enumerate(xs)]
        for p in reference.parameters():
            p.grad = None
        whole = torch.cat(xs).requires_grad_()
        out_ref = reference(whole.unsqueeze(0))[0]
        (out_ref.squeeze(0) * torch.cat(weights)).sum().backward()
        # Compiled: the all-gather dispatch, whose collective dynamo traces with the layer (the all-to-all runs eagerly
        # between two graphs: its compiled layer is tested with inductor on the GPU, tests/gpu/
        # test_expert_parallel_cuda.py). Only on 2 ranks: the number of ranks changes the graphs' sizes, not their
        # operations.
        for compiled in (False, True) if ep == 2 and dispatch == "all_gather" else (False,):
            check_expert_parallel_layer(reference, out_ref, whole.grad, xs, weights, rank, ep, dispatch, compiled)
