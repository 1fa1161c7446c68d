"""What the GPUs' link gives NCCL: the collectives training runs (all-gather, reduce-scatter in bf16 and fp32,
all-to-all), at the sizes a step moves, as nccl-tests reports them (algorithm bandwidth = bytes of the whole
tensor / time; bus bandwidth = what each link carried, for comparing with the link's rating).

    torchrun --nproc-per-node 4 benchmarks/tools/collective_bandwidth.py [--mib 16 64 256]

Run beside a slow multi-GPU step: a link of PCIe rates, not NVLink's, explains a step whose GPUs wait on their
collectives (benchmarks/tools/trace_gaps.py)."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, nargs="+", default=[16, 64, 256], help="size of the whole tensor")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    # nccl-tests' bus bandwidth factors: what each rank's link carries per byte of the whole tensor
    ring = (world - 1) / world
    ops = {
        "all_gather bf16": (torch.bfloat16, ring, lambda whole, part: dist.all_gather_into_tensor(whole, part)),
        "reduce_scatter bf16": (torch.bfloat16, ring, lambda whole, part: dist.reduce_scatter_tensor(part, whole)),
        "reduce_scatter fp32": (torch.float32, ring, lambda whole, part: dist.reduce_scatter_tensor(part, whole)),
        "all_to_all bf16": (torch.bfloat16, ring, lambda whole, part: dist.all_to_all_single(part.repeat(world),
                                                                                          whole)),
    }
    for mib in args.mib:
        for name, (dtype, factor, op) in ops.items():
            numel = mib * 2**20 // torch.empty((), dtype=dtype).element_size() // world * world
            whole = torch.ones(numel, dtype=dtype, device="cuda")
            part = torch.ones(numel // world, dtype=dtype, device="cuda")
            for _ in range(3):
                op(whole, part)
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.repeats):
                op(whole, part)
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1e3 / args.repeats
            algbw = whole.numel() * whole.element_size() / seconds / 1e9
            if rank == 0:
                print(f"{name:>20} {mib:>5} MiB: {seconds * 1e3:8.2f} ms  algbw {algbw:7.1f} GB/s  "
                      f"busbw {algbw * factor:7.1f} GB/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
