"""Host time of one FSDP2 unit's data-parallel work per step, against the same work unsharded.

    torchrun --nproc-per-node 2 benchmarks/fsdp_unit_host.py [--experts 32] [--iters 20] [--profile]
    FAKE_PG=1 python benchmarks/fsdp_unit_host.py          # CPU: collectives as no-ops, small tensors

The unit holds the parameters of one 35B-A3B GDN decoder block (shapes from the real model, built on meta); its
forward touches each parameter once (p.sum()), so a backward gives every parameter a gradient. Prints, per rank,
mean host ms per iteration (the iterations queued, then one sync, so GPU time is not counted unless the host
waited for it):
- unsharded: forward + backward of the bf16 block, no FSDP: the work every data-parallel path shares;
- fsdp2: the same block under fully_shard (bf16 parameters, fp32 reduction): FSDP2's cost is this minus the
  unsharded one;
- fsdp2 unshard + reshard: the gather and the free alone;
- fsdp2, two blocks a unit: fully_shard on a list of two blocks, per block (does FSDP2's cost scale with units or
  with parameters?);
- floors of a flat path: one all_gather_into_tensor of a flat bf16 shard and one split_with_sizes_copy into the
  parameters; one torch._chunk_cat of the bf16 gradients into fp32 and one reduce_scatter_tensor.
`--profile` adds torch.profiler's table of FSDP2's step by self CPU time (rank 0).
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


class Block(nn.Module):
    def __init__(self, shapes: dict[str, torch.Size], dtype):
        super().__init__()
        for i, shape in enumerate(shapes.values()):
            self.register_parameter(f"p{i}", nn.Parameter(torch.ones(shape, dtype=dtype)))

    def forward(self, x):
        return x + sum(p.sum() for p in self.parameters())


def block_shapes(experts: int) -> dict[str, torch.Size]:
    from bench_model import bench_args
    from models.qwen35_moe import Qwen35MoeModel

    with torch.device("meta"):
        model = Qwen35MoeModel(bench_args(1, experts))
    return {n: p.shape for n, p in model.layers["0"].named_parameters()}


def host_ms(fn, iters: int, device: torch.device) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return 1e3 * (time.perf_counter() - start) / iters


def training_step(module: nn.Module, x: torch.Tensor):
    def step():
        module(x).backward()
        module.zero_grad(set_to_none=True)
    return step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    ns = ap.parse_args()
    cuda = torch.cuda.is_available()
    if os.environ.get("FAKE_PG"):
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    else:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    shapes = block_shapes(ns.experts)
    if not cuda:  # CPU: the same parameters, each 256x smaller per dimension
        shapes = {n: torch.Size([max(2, s[0] // 256), *[max(1, d // 256) for d in s[1:]]]) for n, s in shapes.items()}
    half = torch.bfloat16 if cuda else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
    mesh = init_device_mesh(device.type, (ws,))
    x = torch.zeros((), device=device)
    results = {}

    results["unsharded (fwd + bwd, no FSDP)"] = host_ms(training_step(Block(shapes, half).to(device), x),
                                                        ns.iters, device)
    sharded = Block(shapes, torch.float32)
    fully_shard(sharded, mesh=mesh, mp_policy=mp)
    sharded.to(device)
    results["fsdp2 (fwd + bwd)"] = host_ms(training_step(sharded, x), ns.iters, device)
    results["fsdp2 unshard + reshard"] = host_ms(lambda: (sharded.unshard(), sharded.reshard()), ns.iters, device)
    pair = nn.Sequential(Block(shapes, torch.float32), Block(shapes, torch.float32))
    fully_shard(list(pair), mesh=mesh, mp_policy=mp)
    fully_shard(pair, mesh=mesh)  # the root, owning no parameter
    pair.to(device)
    results["fsdp2, two blocks a unit, per block (fwd + bwd)"] = host_ms(training_step(pair, x), ns.iters, device) / 2

    # a flat path's floors; shards padded on dim 0 as FSDP2 pads them
    chunks = [-(-s[0] // ws) * (s.numel() // s[0]) for s in shapes.values()]
    shard = torch.zeros(sum(chunks), dtype=half, device=device)
    gathered = torch.empty(ws * sum(chunks), dtype=half, device=device)
    params = [torch.empty(ws * c, dtype=half, device=device).view(ws, c) for c in chunks]

    def gather():
        dist.all_gather_into_tensor(gathered, shard)
        torch.split_with_sizes_copy(gathered.view(ws, -1), chunks, dim=1, out=params)
    results["floor: 1 all-gather + 1 split copy"] = host_ms(gather, ns.iters, device)
    grads = [torch.ones(ws * c, dtype=half, device=device) for c in chunks]
    rs_in = torch.empty(ws * sum(chunks), dtype=torch.float32, device=device)
    rs_out = torch.empty(sum(chunks), dtype=torch.float32, device=device)

    def reduce():
        torch._chunk_cat(grads, dim=0, num_chunks=ws, out=rs_in.view(ws, -1))
        dist.reduce_scatter_tensor(rs_out, rs_in)
    results["floor: 1 _chunk_cat + 1 reduce-scatter"] = host_ms(reduce, ns.iters, device)

    count = f"({len(shapes)} parameters, {sum(s.numel() for s in shapes.values()) / 1e6:.0f}M)"
    for name, ms in results.items():
        print(f"fsdp_unit_host rank {rank}: {ms:8.3f} ms  {name}  {count}", flush=True)
    if ns.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            host_ms(training_step(sharded, x), ns.iters, device)
        if rank == 0:
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
