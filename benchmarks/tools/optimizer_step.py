"""The optimizer step alone: FastAdam (harness/optim/fast_adam.py, one Triton launch per parameter group) against
torch's fused and foreach AdamW, on the fp32 parameters of the benchmark model (35B-A3B widths; 8 layers and 32
experts: 2.1B).

    python benchmarks/tools/optimizer_step.py --layers 8 --experts 32

Prints milliseconds per step and the bandwidth it streams at (28 bytes per parameter: parameter, gradient and two
moments read, three written), and FastAdam's speed-up over each; all in one process. Needs CUDA.

`--beside-gemms` then asks whether the step could hide behind compute: FastAdam's step alone, bf16 GEMMs of the
lm_head's forward shape (8,192 tokens x 2,048 -> 248,320) alone, as many as take about as long, and both at once on
two streams; it prints how many of the step's milliseconds the GEMMs hid and how much longer both take than
the longer of the two alone.
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
    parser.add_argument("--beside-gemms", action="store_true",
                        help="also FastAdam's step on a second stream beside the lm_head's GEMMs")
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
        optimizer = make(params)
        results[name] = cuda_median_ms(optimizer.step, ns.steps)
        if ns.beside_gemms and name == "FastAdam":
            overlap = step_beside_gemms(optimizer.step, ns.steps)
        del params, optimizer
        torch.cuda.empty_cache()
    print(f"optimizer step: {len(shapes)} fp32 parameters, {n / 1e9:.2f}B values, {torch.cuda.get_device_name()}")
    for name, ms in results.items():
        print(f"  {name:20s} {ms:7.2f} ms  {28 * n / ms / 1e9:6.2f} TB/s  "
              f"FastAdam {ms / results['FastAdam']:.2f}x faster" if name != "FastAdam" else
              f"  {name:20s} {ms:7.2f} ms  {28 * n / ms / 1e9:6.2f} TB/s")
    if ns.beside_gemms:
        print("\n".join(overlap))
    return 0


def step_beside_gemms(step, repeats: int) -> list[str]:
    """The optimizer step alone, the lm_head's forward GEMM repeated for about as long alone, and both at once
    (the step on a second stream): the lines that say how much of the step the GEMMs hid."""
    tokens, hidden, vocab = 8192, 2048, 248_320
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    weight_t = torch.randn(hidden, vocab, device="cuda", dtype=torch.bfloat16)
    logits = torch.empty(tokens, vocab, device="cuda", dtype=torch.bfloat16)
    one_gemm = cuda_median_ms(lambda: torch.mm(h, weight_t, out=logits), repeats)
    step_ms = cuda_median_ms(step, repeats)
    count = max(1, round(step_ms / one_gemm))

    def gemms():
        for _ in range(count):
            torch.mm(h, weight_t, out=logits)

    gemms_ms = cuda_median_ms(gemms, repeats)
    side = torch.cuda.Stream()

    def both():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        gemms()
        torch.cuda.current_stream().wait_stream(side)

    both_ms = cuda_median_ms(both, repeats)
    tflops = 2 * tokens * hidden * vocab * count / gemms_ms / 1e9
    return [f"beside GEMMs: the step {step_ms:.2f} ms alone, {count} lm_head GEMMs {gemms_ms:.2f} ms alone "
            f"({tflops:.0f} TFLOP/s), both on two streams {both_ms:.2f} ms",
            f"  hidden: {step_ms + gemms_ms - both_ms:.2f} of the step's {step_ms:.2f} ms "
            f"({(step_ms + gemms_ms - both_ms) / step_ms:.0%}); both take {both_ms / max(step_ms, gemms_ms):.2f}x "
            f"the longer one alone"]


if __name__ == "__main__":
    sys.exit(main())
