"""How far FLA's gated delta rule (bf16, Hopper guard bypassed) lands from the float64 reference fed the same
bf16 inputs: the measurement behind FLA_CHECK_ERROR_BOUND / FLA_CHECK_BIAS_BOUND in fla_hopper_guard.py
(docs/performance.md, "FLA's gated delta rule against float64").

    python benchmarks/tools/fla_backward_errors.py [35B-A3B gpu-tests 397B-A17B]

For each head shape: the two statistics of `fla_gated_delta_rule_errors` (worst per-head error / bias) per check
case and over all cases with the time of that first check (FLA compiles and autotunes its kernels for the
shape in it); then a kernel whose dg is off by 1% in one head; then what the old, coarser check (reference fed
un-rounded fp32 inputs, one norm over the whole tensor, bound 2e-2) makes of FLA and of that defect.
"""

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
from models.qwen35_moe.kernels.fla_hopper_guard import (  # noqa: E402
    FLA_CHECK_BIAS_BOUND,
    FLA_CHECK_CASES,
    FLA_CHECK_ERROR_BOUND,
    fla_check_failures,
    fla_gated_delta_rule_errors,
    fla_hopper_guard_fires,
)
from models.qwen35_moe.kernels.gated_delta_rule import gated_delta_rule, torch_chunk_gated_delta_rule  # noqa: E402
from tests.fault_injection import kernel_with_wrong_dg  # noqa: E402

SHAPES = {"35B-A3B": (16, 32, 128, 128), "gpu-tests": (2, 4, 128, 128), "397B-A17B": (16, 64, 128, 128)}


def old_check(Hk, Hv, Dk, Dv, kernel, T=300):
    """The previous self-check: reference fed un-rounded fp32 inputs, one norm over the whole tensor."""
    gen = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=gen)
    inputs = [randn(1, T, Hk, Dk), randn(1, T, Hk, Dk), randn(1, T, Hv, Dv),
              F.logsigmoid(randn(1, T, Hv) + 2.0), randn(1, T, Hv).sigmoid()]
    do = randn(1, T, Hv, Dv).cuda()
    cu = torch.tensor([0, 117, T], device="cuda")
    results = []
    for run, cast in ((kernel, torch.bfloat16), (torch_chunk_gated_delta_rule, torch.float32)):
        xs = [x.to("cuda", torch.float32 if i == 3 else cast).requires_grad_() for i, x in enumerate(inputs)]
        o = run(*xs, cu_seqlens=cu)
        results.append([o, *torch.autograd.grad(o, xs, do.to(o.dtype))])
    names = ("o", "dq", "dk", "dv", "dg", "dbeta")
    return {n: ((a.float() - b).norm() / b.norm()).item() for n, a, b in zip(names, *results)}


def fmt(stats):
    return "  ".join(f"{k} {v:.1e}" for k, v in stats.items())


def report(label, errors, biases):
    failures = fla_check_failures(errors, biases)
    print(f"  {label}\n    error {fmt(errors)}\n    bias  {fmt(biases)}\n    -> {'REJECTED: ' + ', '.join(failures) if failures else 'passes'}")


def main(names):
    import fla.ops.common.chunk_o as chunk_o
    import triton

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  guard fires: "
          f"{fla_hopper_guard_fires()}  bounds: error {FLA_CHECK_ERROR_BOUND:.0e}, bias {FLA_CHECK_BIAS_BOUND:.0e}")
    chunk_o.TRITON_ABOVE_3_7_1 = True  # bypass for the measurement
    for name in names:
        Hk, Hv, Dk, Dv = SHAPES[name]
        print(f"\n{name}: Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv}", flush=True)
        start = time.perf_counter()
        stats = fla_gated_delta_rule_errors(Hk, Hv, Dk, Dv, "cuda")
        torch.cuda.synchronize()
        report(f"FLA, all cases (first check of this shape: {time.perf_counter() - start:.1f} s)", *stats)
        start = time.perf_counter()
        fla_gated_delta_rule_errors(Hk, Hv, Dk, Dv, "cuda")
        torch.cuda.synchronize()
        print(f"  (same check again, kernels compiled: {time.perf_counter() - start:.1f} s)")
        for case in FLA_CHECK_CASES:
            report(f"FLA, documents {case}", *fla_gated_delta_rule_errors(Hk, Hv, Dk, Dv, "cuda", cases=(case,)))
        report("dg +1% in head 1", *fla_gated_delta_rule_errors(Hk, Hv, Dk, Dv, "cuda", kernel=kernel_with_wrong_dg(1)))
        print(f"  old check, FLA:              {fmt(old_check(Hk, Hv, Dk, Dv, gated_delta_rule))}")
        print(f"  old check, dg +1% in head 1: {fmt(old_check(Hk, Hv, Dk, Dv, kernel_with_wrong_dg(1)))}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(SHAPES))
