"""One MoE layer of 35B-A3B widths alone, forward and backward, under expert parallelism or with every expert on
every rank: the dispatch's cost without the rest of a training step (docs/performance.md, "256 experts over 4 GPUs").

    torchrun --nproc-per-node 4 benchmarks/tools/moe_layer.py --experts 256 --tokens 16384
    torchrun --nproc-per-node 4 benchmarks/tools/moe_layer.py --layouts local,all_gather --balanced

Each rank routes `--tokens` tokens (hidden 2048, top-8, experts of 512, the shared expert). Layouts: `local`, all
experts on every rank (as FSDP computes them once gathered; the gather itself is not timed), `all_gather` and
`all_to_all`, the experts split over all ranks (parallel/expert_parallel.py). The router is random (a nearly even
load; training's real load comes from benchmarks/train_throughput.py), or `--balanced` (model.router_force_balance:
exactly even). Prints, per layout, the median milliseconds of a forward and backward
over the timed repeats (the slowest rank's), the tokens per second per rank, and the busiest rank's share of the
assignments. On CPU (gloo, `--device cpu`) it only checks that the script runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

from bench_model import bench_args, cuda_median_ms  # noqa: E402

from models.qwen35_moe.hooks import ParallelHooks  # noqa: E402
from models.qwen35_moe.moe import SparseMoE, force_balanced_routing  # noqa: E402
from parallel.expert_parallel import AllGatherExpertParallel, ExpertParallel, shard_experts  # noqa: E402
from parallel.parallelize import DTensorSharding  # noqa: E402

DISPATCH = {"all_gather": AllGatherExpertParallel, "all_to_all": ExpertParallel}


def build_layer(args, layout: str, mesh, device, dtype, balanced: bool) -> SparseMoE:
    torch.manual_seed(0)  # the same weights on every rank and in every layout
    layer = SparseMoE(args)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    layer = layer.to(device, dtype)
    if balanced:
        force_balanced_routing(layer)
    if layout != "local":
        shard_experts(layer.experts, mesh)
        layer.set_parallel_hooks(ParallelHooks(expert_dispatch=lambda moe: DISPATCH[layout](mesh),
                                               sharding=DTensorSharding()))
    return layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens each rank routes")
    parser.add_argument("--layouts", default="local,all_gather,all_to_all")
    parser.add_argument("--balanced", action="store_true", help="every expert the same load")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--flavor", default="35B-A3B", help="layer widths (debugmodel: a quick check on CPU)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ns = parser.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if ns.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device(ns.device, torch.cuda.current_device()) if ns.device == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if ns.device == "cuda" else "gloo")
    mesh = init_device_mesh(ns.device, (world,))
    dtype = torch.bfloat16 if ns.device == "cuda" else torch.float32
    args = bench_args(1, ns.experts, ns.flavor)
    torch.manual_seed(1 + rank)  # each rank its own tokens
    x = torch.randn(ns.tokens, args.hidden_size, device=device, dtype=dtype)
    probe = torch.randn_like(x)
    for layout in ns.layouts.split(","):
        layer = build_layer(args, layout, mesh, device, dtype, ns.balanced)
        inputs = x.clone().requires_grad_()
        counts = []

        def step(layer=layer):
            out, layer_counts, _ = layer(inputs[None])
            (out[0].float() * probe).sum().backward()
            counts.append(layer_counts)

        if ns.device == "cuda":
            ms = cuda_median_ms(step, ns.repeats, before=dist.barrier)
        else:
            for _ in range(2):
                step()
            ms = float("nan")
        slowest = torch.tensor([ms], device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        load = counts[-1].clone()
        dist.all_reduce(load)  # assignments per expert over all ranks' tokens
        per_rank = load.view(world, -1).sum(1)  # as EP splits the experts
        if rank == 0:
            share = (per_rank.max() / per_rank.sum()).item()
            busiest = "" if layout == "local" else f", busiest rank {share:.1%} of the assignments"
            rate = ns.tokens / slowest.item() * 1e3
            print(f"{layout:>10} ({'balanced' if ns.balanced else 'random router'}): {slowest.item():8.2f} ms "
                  f"fwd+bwd, {rate:,.0f} tokens/s per rank{busiest}", flush=True)
        del layer  # the layout's weights freed before the next
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
