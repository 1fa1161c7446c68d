"""The optimizer step alone: FastAdam (harness/optim/fast_adam.py, one Triton launch per parameter group) against torch's
fused and foreach AdamW, on the fp32 parameters of the benchmark model (35B-A3B widths; 8 layers and 32 experts: 2.1B).

    python benchmarks/tools/optimizer_step.py --layers 8 --experts 32

Prints milliseconds per step and the bandwidth it streams at (28 bytes per parameter: parameter, gradient and two
moments read, three written), and FastAdam's speed-up over each; all in one process. Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from bench_model import bench_args, cuda_median_ms  # noqa: E402
from harness.optim.fast_adam import FastAdam  # noqa: E402
from models.qwen35_moe import Qwen35MoeModel  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    ns = parser.parse_args()
    if not torch.cuda.is_available():
        print("optimizer_step: needs CUDA")
        return 2
    with torch.device("meta"):
        shapes = [p.shape for p in Qwen35MoeModel(bench_args(ns.layers, ns.experts)).parameters()]
    n = sum(s.numel() for s in shapes)
    kwargs = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    makers = {"torch fused AdamW": lambda ps: torch.optim.AdamW(ps, fused=True, **kwargs),
              "torch foreach AdamW": lambda ps: torch.optim.AdamW(ps, foreach=True, **kwargs),
              "FastAdam": lambda ps: FastAdam(ps, **kwargs)}
    results = {}
    for name, make in makers.items():
        params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        results[name] = cuda_median_ms(make(params).step, ns.steps)
        del params
        torch.cuda.empty_cache()
    print(f"optimizer step: {len(shapes)} fp32 parameters, {n / 1e9:.2f}B values, {torch.cuda.get_device_name()}")
    for name, ms in results.items():
        print(f"  {name:20s} {ms:7.2f} ms  {28 * n / ms / 1e9:6.2f} TB/s  "
              f"FastAdam {ms / results['FastAdam']:.2f}x faster" if name != "FastAdam" else
              f"  {name:20s} {ms:7.2f} ms  {28 * n / ms / 1e9:6.2f} TB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
