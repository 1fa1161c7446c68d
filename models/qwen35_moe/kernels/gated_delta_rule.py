"""Gated delta rule (the Gated DeltaNet token mixer), one signature for every device.

Per value head, with L2-normalised q, k and q scaled by Dk**-0.5, the state S (Dk, Dv) evolves as
    S_t = exp(g_t) S_{t-1};  delta_t = beta_t (v_t - S_t^T k_t);  S_t += k_t delta_t^T;  o_t = S_t^T q_t
and is reset to zero at every document start. Value head h reads key head h // (Hv // Hk).

- `gated_delta_rule`: CUDA tensors -> FLA's chunked kernels (fla_saved_states.py: FLA's function, with the chunk
  states kept for the backward); anything else -> `torch_chunk_gated_delta_rule`.
- `torch_chunk_gated_delta_rule`: pure torch chunked form, differentiable by autograd.
- `naive_recurrent_gated_delta_rule`: token-by-token reference for tests.
- `require_fla`: CUDA needs FLA installed (and warns where it is not a release its internals were checked on).
  FLA 0.6.0's Hopper backward guard and its self-checked bypass: fla_hopper_guard.py.
"""

import functools
import importlib.metadata
import importlib.util
import logging

import torch
import torch.nn.functional as F

from .fla_saved_states import SavedStatesGatedDeltaRule
from .fla_varlen import fla_varlen_args

logger = logging.getLogger(__name__)

# The FLA releases on which the project's use of FLA's internals was checked: its chunked kernels' own functions,
# called in its order (fla_saved_states.py; tests/gpu/test_fla_kernels.py) and the flag its Hopper guard reads
# (fla_hopper_guard.py; tests/gpu/test_fla_hopper_guard.py).
CHECKED_FLA_VERSIONS = ("0.6.0",)

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


class FlaKernelsUnavailableError(RuntimeError):
    """FLA's kernels cannot train on this machine: not installed, or its backward refused (and not bypassed)."""


def require_fla() -> None:
    """CUDA training runs FLA's kernels: stop at once, naming the install, when the package is missing."""
    if importlib.util.find_spec("fla") is None:
        raise FlaKernelsUnavailableError(
            "training on CUDA needs FLA's kernels (package fla-core), which are not installed: "
            "pip install -e '.[gpu]' (or pip install 'fla-core>=0.6,<0.7')")
    warn_if_fla_unchecked()


@functools.cache
def warn_if_fla_unchecked() -> None:
    """Log once when the installed FLA is not a release its internals were checked on (CHECKED_FLA_VERSIONS)."""
    try:
        installed = importlib.metadata.version("fla-core")
    except importlib.metadata.PackageNotFoundError:
        installed = "not installed as fla-core"
    if installed not in CHECKED_FLA_VERSIONS:
        logger.warning("FLA's internals (its kernels' own functions, its Hopper guard's flag) were checked on fla-core "
                       "%s only, not %s: run tests/gpu/test_fla_kernels.py and tests/gpu/test_fla_hopper_guard.py",
                       " and ".join(CHECKED_FLA_VERSIONS), installed)
