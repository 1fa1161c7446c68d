"""Gated delta rule (the Gated DeltaNet token mixer), one signature for every device.

Per value head, with L2-normalised q, k and q scaled by Dk**-0.5, the state S (Dk, Dv) evolves as
    S_t = exp(g_t) S_{t-1};  delta_t = beta_t (v_t - S_t^T k_t);  S_t += k_t delta_t^T;  o_t = S_t^T q_t
and is reset to zero at every document start. Value head h reads key head h // (Hv // Hk).

- `gated_delta_rule`: CUDA tensors -> FLA's chunked kernels (fla_saved_states.py: FLA's function, with the chunk
  states kept for the backward); anything else -> `torch_chunk_gated_delta_rule`.
- `torch_chunk_gated_delta_rule`: pure torch chunked form, differentiable by autograd.
- `naive_recurrent_gated_delta_rule`: token-by-token reference for tests.
- `enable_fla_hopper_backward`: explicit, self-checked bypass of FLA 0.6.0's Hopper backward guard.
"""

import importlib
import importlib.util
import logging

import torch
import torch.nn.functional as F

from .fla_saved_states import SavedStatesGatedDeltaRule
from .fla_varlen import fla_varlen_args

logger = logging.getLogger(__name__)


def gated_delta_rule(q, k, v, g, beta, cu_seqlens=None, cu_seqlens_cpu=None):
    """q, k (B, T, Hk, Dk); v (B, T, Hv, Dv); g, beta (B, T, Hv); cu_seqlens int [N+1] (needs B == 1), with an
    optional host copy `cu_seqlens_cpu` that spares FLA a device-to-host sync. Returns o (B, T, Hv, Dv) in v's
    dtype."""
    if cu_seqlens is not None and q.shape[0] != 1:
        raise ValueError(f"gated_delta_rule: cu_seqlens packs documents into one row, so batch size must be 1, "
                         f"got q of shape {tuple(q.shape)}; flatten the batch to (1, B*T, ...) first.")
    if q.device.type != "cuda":
        return torch_chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens)
    # q and k are normalised and repeated for their value heads here, in the caller's compiled graph (inductor fuses
    # both into one pass, forward and backward), not by FLA: for grouped value heads FLA's backward sums dq and dk
    # over each key head's value heads with slow strided reductions of its own, and its l2norm kernels go with them
    # (docs/performance.md, "Tried, not kept").
    q, k = _qk_per_value_head(q, k, v.shape[2])
    return _fla_gated_delta_rule(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu)


# Under torch.compile (compile.enable) the FLA call is one graph break (FLA marks its own entry point so too): traced,
# its host-side preparation (chunk indices from cu_seqlens, data-dependent shapes) would recompile per layout.
@torch.compiler.disable
def _fla_gated_delta_rule(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu):
    # Without a host copy the chunk index is None, and each FLA kernel function builds it (cached) as FLA's does.
    varlen = fla_varlen_args(cu_seqlens, cu_seqlens_cpu, q.device)
    o = SavedStatesGatedDeltaRule.apply(q, k, v, g, beta, q.shape[-1] ** -0.5, varlen["cu_seqlens"],
                                        varlen["chunk_indices"])
    return o.to(v.dtype)


def _l2norm(x):
    # Same formula and eps as FLA's use_qk_l2norm_in_kernel (and transformers' l2norm).
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def _qk_per_value_head(q, k, Hv):
    """q, k (B, T, Hk, Dk) -> (B, T, Hv, Dk): L2-normalised in at least fp32 and rounded back to their dtype once
    (as FLA's l2norm kernel does), then repeated for the value heads that read them (GVA)."""
    Hk = k.shape[2]
    if Hv % Hk != 0:
        raise ValueError(f"gated delta rule: value heads ({Hv}) must be a multiple of key heads ({Hk}).")
    return tuple(_l2norm(x.to(torch.promote_types(x.dtype, torch.float32))).to(x.dtype).repeat_interleave(
        Hv // Hk, dim=2) for x in (q, k))


def _prepare(q, k, v, g, beta):
    """Math dtype (fp32, or fp64 if given), GVA head expansion, q/k normalisation and q scaling."""
    dtype = torch.promote_types(v.dtype, torch.float32)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    q, k = _qk_per_value_head(q, k, v.shape[2])  # (B, T, Hv, Dk)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def _check_cu_seqlens(cu_seqlens, B, T):
    if cu_seqlens is None:
        return
    if B != 1:
        raise ValueError(f"cu_seqlens packs documents into one row, so batch size must be 1, got {B}; "
                         f"flatten the batch to (1, B*T, ...) first.")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the sequence length {T}, got {cu}.")


# Eager under torch.compile too: its host loop over chunks and its sizes read from cu_seqlens would recompile the
# block for every document layout.
@torch.compiler.disable
def torch_chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=None, chunk_size=64):
    """Chunked gated delta rule in pure torch (fp32 math, fp64 if given fp64); same contract as gated_delta_rule.

    Every document is padded to a multiple of chunk_size with q = k = v = beta = g = 0 tokens (which leave the
    state unchanged), so documents start at chunk boundaries: the intra-chunk work is batched over all chunks
    of all documents, and the sequential scan over chunks zeroes the state where a chunk starts a document."""
    B, T, _, _ = q.shape
    _check_cu_seqlens(cu_seqlens, B, T)
    Hv, Dv, C, out_dtype = v.shape[2], v.shape[3], chunk_size, v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    if cu_seqlens is None:  # each row is one document of the flattened stream
        cu_seqlens = torch.arange(B + 1, device=q.device) * T
    cu = cu_seqlens.to(device=q.device, dtype=torch.long)
    N = B * T

    # Where each token goes in the padded stream.
    lens = cu.diff()                                                   # (docs,)
    padded = (lens + C - 1) // C * C
    pstart = F.pad(padded.cumsum(0), (1, 0))                           # (docs + 1,)
    tok = torch.arange(N, device=q.device)
    doc = torch.searchsorted(cu, tok, right=True) - 1                  # (N,)
    dest = pstart[doc] + tok - cu[doc]                                 # (N,) position in the padded stream
    Np = int(pstart[-1])
    src = torch.full((Np,), N, dtype=torch.long, device=q.device)      # N points at an appended zero token
    src[dest] = tok
    NC = Np // C
    starts = torch.zeros(NC, dtype=torch.bool)
    starts[(pstart[:-1][lens > 0] // C).cpu()] = True

    def chunked(x):  # (B, T, Hv, ...) -> (Hv, NC, C, ...), padding tokens all zero
        x = x.reshape(N, *x.shape[2:])
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[src]          # (Np, Hv, ...)
        return x.movedim(0, 1).reshape(Hv, NC, C, *x.shape[2:])

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))        # (Hv, NC, C[, D])

    # Intra-chunk (all chunks at once). G_i = sum of g up to i within the chunk; decay from j to i = exp(G_i - G_j).
    G = g.cumsum(-1)                                                    # (Hv, NC, C)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (Hv, NC, C, C)
    # Unrolling the recurrence in a chunk gives (I + A) delta = beta * (v - exp(G) * k S0) with A strictly lower,
    # so delta = u - w S0 (the WY/UT form): one unit-triangular solve per chunk.
    A = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)  # (Hv, NC, C, C)
    I_A = A + torch.eye(C, dtype=A.dtype, device=A.device)
    u = torch.linalg.solve_triangular(I_A, beta[..., None] * v, upper=False, unitriangular=True)  # (.., C, Dv)
    w = torch.linalg.solve_triangular(I_A, (beta * G.exp())[..., None] * k, upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay                              # (Hv, NC, C, C), diagonal included
    q_decayed = q * G.exp()[..., None]                                  # reads the incoming state S0
    k_decayed = k * (G[..., -1:] - G).exp()[..., None]                  # writes into the outgoing state
    chunk_decay = G[..., -1].exp()[..., None, None]                     # (Hv, NC, 1, 1)

    # Sequential scan over chunks.
    S = q.new_zeros(Hv, k.shape[-1], Dv)                               # (Hv, Dk, Dv)
    out = []
    for n, is_start in enumerate(starts.tolist()):
        if is_start:
            S = torch.zeros_like(S)
        delta = u[:, n] - w[:, n] @ S                                   # (Hv, C, Dv)
        out.append(q_decayed[:, n] @ S + qk[:, n] @ delta)
        S = chunk_decay[:, n] * S + k_decayed[:, n].transpose(-1, -2) @ delta
    o = torch.stack(out, 1).reshape(Hv, Np, Dv).movedim(1, 0)[dest]    # (N, Hv, Dv)
    return o.reshape(B, T, Hv, Dv).to(out_dtype)


def naive_recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens=None):
    """Token-by-token reference (fp32, fp64 if given fp64); same contract as gated_delta_rule. For tests."""
    B, T, _, _ = q.shape
    _check_cu_seqlens(cu_seqlens, B, T)
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    starts = {0} if cu_seqlens is None else set(cu_seqlens[:-1].tolist())  # B > 1: every row starts at t = 0
    S = q.new_zeros(B, v.shape[2], k.shape[-1], v.shape[-1])           # (B, Hv, Dk, Dv)
    out = []
    for t in range(T):
        if t in starts:
            S = torch.zeros_like(S)
        S = g[:, t].exp()[..., None, None] * S
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))  # (B, Hv, Dv)
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(out, 1).to(out_dtype)                            # (B, T, Hv, Dv)


# ---------------------------------------------------------------------------------------------------------------
# FLA 0.6.0 on Hopper with Triton in [3.4, 3.7.1): its gated backward (chunk_bwd_dqkwg) is refused because a
# Triton codegen bug can return wrong dg / dbeta for some tile shapes. `enable_fla_hopper_backward` lifts
# that refusal only after `fla_gated_delta_rule_errors` shows, on the run's own head shapes, that FLA's output
# and every gradient match a float64 reference fed the very same bf16 inputs, head by head.

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


class FlaKernelsUnavailableError(RuntimeError):
    """FLA's kernels cannot train on this machine: not installed, or its backward refused (and not bypassed)."""


def require_fla() -> None:
    """CUDA training runs FLA's kernels: stop at once, naming the install, when the package is missing."""
    if importlib.util.find_spec("fla") is None:
        raise FlaKernelsUnavailableError(
            "training on CUDA needs FLA's kernels (package fla-core), which are not installed: "
            "pip install -e '.[gpu]' (or pip install 'fla-core>=0.6,<0.7')")


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
    chunk_o = importlib.import_module("fla.ops.common.chunk_o")  # holds the flag FLA's guard reads

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
