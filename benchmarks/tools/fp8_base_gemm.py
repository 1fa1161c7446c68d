"""A frozen FP8 base weight's two GEMMs in a LoRA step (the forward, y = x W^T, and the backward to the inputs,
dx = dy W) at the full-size 35B-A3B's dense shapes, two ways, on one GPU:

- dequantize: W = value x its 128 x 128 block's scale, in fp32 rounded once to bf16 (models/qwen35_moe/fp8_hold.py's
  path, compiled as in a compiled block), then bf16 GEMMs;
- fp8 GEMM: the activations (and the incoming gradients) quantized per 1 x 128 group, then torch's block-scaled FP8
  GEMM (torch.nn.functional.scaled_mm, BlockWise1x128 x BlockWise128x128); the backward needs W^T's float8 values
  in the other major order, transposed per use here (storing them would hold the base twice).

For each shape: milliseconds per use of each path (CUDA events, median of --iters), their ratio, and the FP8
result's relative error against the bf16 one; then both summed over the model's dense projections for one row of
--tokens tokens. The routed experts' grouped GEMMs have no block-scaled grouped FP8 GEMM in torch to compare with;
the script says whether torch.nn.functional.scaled_grouped_mm exists.

    python benchmarks/tools/fp8_base_gemm.py [--tokens 4096] [--iters 50]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from models.qwen35_moe.fp8_blocks import FP8, FP8_MAX, dequantize_blocks, quantize_blocks  # noqa: E402

# The 35B-A3B's dense projections that its FP8 release quantizes: (name, out, in, per model): 30 Gated DeltaNet
# layers (in_proj_qkv, in_proj_z, out_proj), 10 attention layers (q with its gate, k, v, o), 40 shared experts.
SHAPES = [("gdn in_proj_qkv", 8192, 2048, 30), ("gdn in_proj_z", 4096, 2048, 30), ("gdn out_proj", 2048, 4096, 30),
          ("attn q_proj", 8192, 2048, 10), ("attn k_proj", 512, 2048, 10), ("attn v_proj", 512, 2048, 10),
          ("attn o_proj", 2048, 4096, 10), ("shared gate_proj", 512, 2048, 40), ("shared up_proj", 512, 2048, 40),
          ("shared down_proj", 2048, 512, 40)]


@torch.compile
def dequantize_bf16(value: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return dequantize_blocks(value, scale, torch.bfloat16)


@torch.compile
def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, K) in float8 per 1 x 128 group, and its scales (T, K / 128) in the column-major layout scaled_mm reads."""
    groups = x.float().unflatten(-1, (-1, 128))
    scale = groups.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    value = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).flatten(-2)
    return value, scale.t().contiguous().t()


def dequantized_path(x, dy, value, scale):
    weight = dequantize_bf16(value, scale)
    return x @ weight.t(), dy @ weight


def fp8_path(x, dy, value, scale):
    x8, xs = quantize_groups(x)
    y = F.scaled_mm(x8, value.t(), xs, F.ScalingType.BlockWise1x128, scale.t(), F.ScalingType.BlockWise128x128,
                    output_dtype=torch.bfloat16)
    dy8, dys = quantize_groups(dy)
    value_t = value.t().contiguous()  # (in, out): W's values in the other major order
    dx = F.scaled_mm(dy8, value_t.t(), dys, F.ScalingType.BlockWise1x128, scale.t().contiguous().t(),
                     F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)  # the block scales column-major
    return y, dx


def milliseconds(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=50)
    ns = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {ns.tokens} tokens")
    totals = {"dequantize": 0.0, "fp8": 0.0}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, out, inner, count in SHAPES:
        weight = torch.randn(out, inner, device="cuda", generator=g) * 0.02
        value, scale = quantize_blocks(weight)
        x = torch.randn(ns.tokens, inner, device="cuda", generator=g, dtype=torch.bfloat16)
        dy = torch.randn(ns.tokens, out, device="cuda", generator=g, dtype=torch.bfloat16)
        y_ref, dx_ref = dequantized_path(x, dy, value, scale)
        try:
            y, dx = fp8_path(x, dy, value, scale)
        except Exception as e:  # no block-scaled FP8 GEMM on this GPU / torch / cuBLAS
            print(f"{name}: the FP8 GEMM failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
            return 1
        error = max(((y.float() - y_ref.float()).norm() / y_ref.float().norm()).item(),
                    ((dx.float() - dx_ref.float()).norm() / dx_ref.float().norm()).item())
        times = {"dequantize": milliseconds(lambda: dequantized_path(x, dy, value, scale), ns.iters),
                 "fp8": milliseconds(lambda: fp8_path(x, dy, value, scale), ns.iters)}
        for path, t in times.items():
            totals[path] += t * count
        print(f"{name:17s} ({out} x {inner}) x {count}: dequantize + bf16 {times['dequantize']:.3f} ms, fp8 GEMM "
              f"{times['fp8']:.3f} ms ({times['dequantize'] / times['fp8']:.2f}x), fp8's relative error "
              f"{error:.2e}", flush=True)
    print(f"the model's dense projections, forward + backward to the inputs, one row of {ns.tokens} tokens: "
          f"dequantize + bf16 {totals['dequantize']:.1f} ms, fp8 GEMM {totals['fp8']:.1f} ms "
          f"({totals['dequantize'] / totals['fp8']:.2f}x)")
    print(f"block-scaled grouped FP8 GEMM for the routed experts: torch.nn.functional.scaled_grouped_mm "
          f"{'exists' if hasattr(F, 'scaled_grouped_mm') else 'does not exist'} in this torch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
