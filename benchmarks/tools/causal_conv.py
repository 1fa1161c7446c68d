"""Gated DeltaNet's causal conv + SiLU alone: our kernel (models/qwen35_moe/kernels/causal_conv_triton.py, q, k and v
written as separate contiguous tensors) against FLA's (one (T, C) output whose q, k and v views FLA's delta rule
copies to contiguous tensors, counted here, as is the concatenation of their gradients in backward).

    python benchmarks/tools/causal_conv.py                    # 35B-A3B's layer: 2 x 4096 tokens, 2048 + 2048 + 4096

Packed rows (documents of 1,000 tokens); bf16. Prints the GPU time (the kernels' summed durations) forward and
forward + backward, the bandwidth that would be if x, y, dy and dx moved once, and the speed-up; all in one
process. Needs CUDA and FLA.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from models.qwen35_moe.documents import document_layout  # noqa: E402
from models.qwen35_moe.kernels.causal_conv import causal_conv1d_qkv  # noqa: E402


def gpu_ms_per_call(fn, calls: int, warmup: int = 5) -> float:
    """GPU time per call of fn: the summed durations of the kernels it launches (torch.profiler), so that the
    host's launch overhead, which eager calls of these small kernels would expose to CUDA events, is left out
    (in a training step the compiled graph queues them ahead of the GPU)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in kernels) / calls / 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--parts", type=int, nargs=3, default=[2048, 2048, 4096])
    parser.add_argument("--document", type=int, default=1000, help="document length in the packed rows")
    parser.add_argument("--steps", type=int, default=50)
    ns = parser.parse_args()
    if not torch.cuda.is_available():
        print("causal_conv: needs CUDA")
        return 2
    from fla.modules.causal_conv1d import causal_conv1d as fla_causal_conv1d

    parts, channels, n = ns.parts, sum(ns.parts), ns.rows * ns.seq
    positions = (torch.arange(ns.seq) % ns.document).expand(ns.rows, ns.seq)
    cu_seqlens = document_layout(positions, ns.rows, ns.seq, torch.device("cpu")).cu_seqlens.cuda()
    positions = positions.cuda()
    x = torch.randn(1, n, channels, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(channels, 4, device="cuda") / 2).to(torch.bfloat16).requires_grad_()
    grads = [torch.randn(1, n, c, device="cuda", dtype=torch.bfloat16) for c in parts]

    def ours():
        return causal_conv1d_qkv(x, weight, parts, positions)

    def flas():
        y, _ = fla_causal_conv1d(x, weight, activation="silu", cu_seqlens=cu_seqlens)
        return [t.contiguous() for t in y.split(parts, dim=-1)]  # what FLA's delta rule does with the views

    def forward_backward(fn):
        return lambda: torch.autograd.grad(fn(), (x, weight), grads)

    results = {}
    for name, fn in (("FLA", flas), ("ours", ours)):
        with torch.no_grad():
            forward = gpu_ms_per_call(fn, ns.steps)
        results[name] = (forward, gpu_ms_per_call(forward_backward(fn), ns.steps))
    moved = 5 * n * channels * 2  # bytes of x and y (forward), x, dy and dx (backward), each moved once
    print(f"causal conv + SiLU: {ns.rows} x {ns.seq} tokens (documents of {ns.document}), channels {parts}, "
          f"bf16, {torch.cuda.get_device_name()}")
    for name, (fwd, both) in results.items():
        print(f"  {name:5s} forward {fwd:6.3f} ms   forward + backward {both:6.3f} ms  "
              f"({moved / both / 1e9:5.2f} TB/s if x, y, dy and dx moved once)")
    fla_fwd, fla_both = results["FLA"]
    our_fwd, our_both = results["ours"]
    print(f"  ours vs FLA: forward {fla_fwd / our_fwd:.2f}x, forward + backward {fla_both / our_both:.2f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
