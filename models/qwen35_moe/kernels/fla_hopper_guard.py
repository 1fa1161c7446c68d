"""FLA 0.6.0's Hopper backward guard and its self-checked bypass (docs/design.md, "Kernels and devices").

FLA 0.6.0 on Hopper with Triton in [3.4, 3.7.1) refuses its gated backward (chunk_bwd_dqkwg) because a Triton codegen
bug can return wrong dg / dbeta for some tile shapes. The guard reads a flag of FLA's module, `TRITON_ABOVE_3_7_1` of
fla.ops.common.chunk_o, at each call. `enable_fla_hopper_backward` sets that flag, the one place the project writes
into FLA, and only after `fla_gated_delta_rule_errors` shows, on the run's own head shapes, that FLA's output and
every gradient match a float64 reference fed the very same bf16 inputs, head by head.

That flag and what reads it are FLA's internals: tests/gpu/test_fla_hopper_guard.py checks, on the installed FLA,
that the flag is what its guard reads; an FLA other than gated_delta_rule.CHECKED_FLA_VERSIONS logs a warning once.
"""

import importlib
import importlib.util
import logging

import torch
import torch.nn.functional as F

from .gated_delta_rule import (
    FlaKernelsUnavailableError,
    gated_delta_rule,
    torch_chunk_gated_delta_rule,
    warn_if_fla_unchecked,
)

logger = logging.getLogger(__name__)

GUARD_MODULE = "fla.ops.common.chunk_o"  # holds the flag FLA's guard reads

# Document boundaries of the packed rows checked: one chunk; two documents whose length is no multiple of the
# 64-token chunk; documents including one shorter than a chunk, with boundaries inside chunks. All varlen, as
# the model runs packed rows: FLA compiles and autotunes its kernels once per shape and layout (docs/performance.md,
# "Start-up and CPU"), and these are the kernels the run then uses.
FLA_CHECK_CASES = ((0, 64), (0, 300, 600), (0, 117, 130, 700, 1000))
# Bounds on the two statistics of `fla_gated_delta_rule_errors`, set from FLA's bf16 kernels with the guard bypassed
# at the 35B-A3B and test head shapes (docs/performance.md, "FLA's gated delta rule against float64", measured with
# benchmarks/tools/fla_backward_errors.py):
# - error (per-head max |FLA - ref| / max |ref|): bf16 outputs alone round by up to 2^-8 = 3.9e-3 of a head's
#   largest element and FLA's bf16 intermediates add to it. The bound, well above FLA's largest, catches gross
#   errors - a wrong tile, sign or reset - which is what the Triton bug gives.
# - bias (per-head |<FLA - ref, ref>| / <ref, ref>, sums over the cases): a head's relative scale error, in which
#   rounding noise averages out over its ~1,700 tokens. The bound sits between FLA's largest and what a dg 1% off
#   in one head gives.
FLA_CHECK_ERROR_BOUND = 5e-2
FLA_CHECK_BIAS_BOUND = 3e-3
_GRADIENTS = ("o", "dq", "dk", "dv", "dg", "dbeta")
_PASSED_CHECKS: dict[tuple, dict] = {}  # one check per head shape and process


def fla_hopper_guard_fires() -> bool:
    """Whether FLA 0.6.0 would refuse the gated delta rule backward on this machine: a Hopper GPU, Triton in
    [3.4, 3.7.1), and no tilelang (with tilelang installed FLA takes its TileLang kernel instead)."""
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1  # FLA's own, never flipped
    return IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1 and not importlib.util.find_spec("tilelang")


def fla_check_failures(errors: dict[str, float], biases: dict[str, float]) -> list[str]:
    """The statistics of `fla_gated_delta_rule_errors` beyond their bounds, e.g. ["dg bias 1.0e-02"]."""
    return ([f"{n} error {e:.1e}" for n, e in errors.items() if not e <= FLA_CHECK_ERROR_BOUND]
            + [f"{n} bias {b:.1e}" for n, b in biases.items() if not b <= FLA_CHECK_BIAS_BOUND])


def enable_fla_hopper_backward(num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, device,
                               kernel=None) -> dict:
    """Bypass FLA's Hopper guard where it would fire, if and only if FLA (or `kernel`, for tests) passes the
    self-check on these head shapes. Returns {"needed": False} where the guard does not fire, else the measured
    statistics; raises FlaKernelsUnavailableError (guard left in place) when the check fails."""
    if not fla_hopper_guard_fires():
        return {"needed": False}
    warn_if_fla_unchecked()
    chunk_o = importlib.import_module(GUARD_MODULE)

    key = (num_k_heads, num_v_heads, head_k_dim, head_v_dim, str(device), kernel)
    if key in _PASSED_CHECKS and chunk_o.TRITON_ABOVE_3_7_1:
        return _PASSED_CHECKS[key]
    shapes = f"Hk={num_k_heads} Hv={num_v_heads} Dk={head_k_dim} Dv={head_v_dim}"
    previous, chunk_o.TRITON_ABOVE_3_7_1 = chunk_o.TRITON_ABOVE_3_7_1, True
    try:
        errors, biases = fla_gated_delta_rule_errors(num_k_heads, num_v_heads, head_k_dim, head_v_dim, device, kernel)
    except BaseException:
        chunk_o.TRITON_ABOVE_3_7_1 = previous
        raise
    shown = ", ".join(f"{n} {errors[n]:.1e}/{biases[n]:.1e}" for n in _GRADIENTS)
    failures = fla_check_failures(errors, biases)
    if failures:
        chunk_o.TRITON_ABOVE_3_7_1 = previous
        raise FlaKernelsUnavailableError(
            f"FLA's gated delta rule on this GPU (Hopper, Triton < 3.7.1) disagrees with the float64 reference on "
            f"{shapes}: {', '.join(failures)} (bounds: error {FLA_CHECK_ERROR_BOUND:.0e}, bias "
            f"{FLA_CHECK_BIAS_BOUND:.0e}). Not bypassing FLA's guard: install Triton >= 3.7.1 (or tilelang).")
    logger.warning("FLA refuses the gated delta rule backward on Hopper with Triton < 3.7.1 (a codegen bug for some "
                   "tile shapes); bypassed after a self-check on %s, worst per-head error/bias: %s (bounds %.0e/%.0e).",
                   shapes, shown, FLA_CHECK_ERROR_BOUND, FLA_CHECK_BIAS_BOUND)
    _PASSED_CHECKS[key] = {"needed": True, **{f"{n}_error": e for n, e in errors.items()},
                           **{f"{n}_bias": b for n, b in biases.items()}}
    return _PASSED_CHECKS[key]


def refuse_fla_hopper_backward() -> None:
    """For model.fla_hopper_backward = "off": stop at once, rather than at the first backward, where FLA's
    guard fires."""
    if fla_hopper_guard_fires():
        raise FlaKernelsUnavailableError(
            "FLA 0.6.0 refuses the gated delta rule backward on Hopper GPUs with Triton >= 3.4 and < 3.7.1 "
            "(chunk_bwd_dqkwg can return wrong gradients there) and model.fla_hopper_backward is off: install "
            "Triton >= 3.7.1 (or tilelang), or set model.fla_hopper_backward = \"auto\" to bypass the guard after "
            "a numerical self-check.")


def _per_head(x: torch.Tensor) -> torch.Tensor:
    """(B, T, H[, D]) -> (H, B*T[*D]) in float64."""
    return x.double().movedim(2, 0).flatten(1)


def fla_gated_delta_rule_errors(Hk, Hv, Dk, Dv, device, kernel=None, cases=FLA_CHECK_CASES,
                                dtype=torch.bfloat16) -> tuple[dict[str, float], dict[str, float]]:
    """How far `kernel` (FLA's `gated_delta_rule` by default) lands from `torch_chunk_gated_delta_rule` in float64
    fed the same `dtype`-rounded inputs (g in fp32, as the model computes it), for the output and the gradients
    of q, k, v, g, beta. Returns two dicts keyed o, dq, dk, dv, dg, dbeta:
      errors  worst over cases and heads of max |actual - ref| / max |ref| within the head;
      biases  worst over heads of |<actual - ref, ref>| / <ref, ref>, summed over the cases (relative scale).
    """
    kernel = gated_delta_rule if kernel is None else kernel
    errors = dict.fromkeys(_GRADIENTS, 0.0)
    dots, norms = {}, {}  # per gradient: (H,) sums over cases of <actual - ref, ref> and <ref, ref>
    gen = torch.Generator().manual_seed(0)
    for cu in cases:
        B, T = 1, cu[-1]
        randn = lambda *shape: torch.randn(*shape, generator=gen)
        # Mild decays (most |g| < 1), so states carry across chunks and every term of the backward matters.
        inputs = [randn(B, T, Hk, Dk).to(dtype), randn(B, T, Hk, Dk).to(dtype), randn(B, T, Hv, Dv).to(dtype),
                  F.logsigmoid(randn(B, T, Hv) + 2.0), randn(B, T, Hv).sigmoid().to(dtype)]
        do = randn(B, T, Hv, Dv).to(dtype)
        cu_seqlens = torch.tensor(cu, device=device)
        results = []
        for run, cast in ((kernel, None), (torch_chunk_gated_delta_rule, torch.float64)):
            xs = [x.to(device, cast or x.dtype).requires_grad_() for x in inputs]
            o = run(*xs, cu_seqlens=cu_seqlens)
            results.append([o, *torch.autograd.grad(o, xs, do.to(device, o.dtype))])
        for name, actual, ref in zip(_GRADIENTS, *results):
            diff, ref = _per_head(actual) - _per_head(ref), _per_head(ref)
            err = diff.abs().amax(1) / ref.abs().amax(1).clamp_min(1e-30)
            errors[name] = max(errors[name], err.max().item())
            dots[name] = dots.get(name, 0) + (diff * ref).sum(1)
            norms[name] = norms.get(name, 0) + (ref * ref).sum(1)
    biases = {n: (dots[n].abs() / norms[n].clamp_min(1e-300)).max().item() for n in _GRADIENTS}
    return errors, biases
