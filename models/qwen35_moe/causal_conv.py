"""Depthwise causal conv + SiLU (Gated DeltaNet's short conv on q, k, v), with document resets.

out[t] = silu(sum_{j<W} weight[:, W-1-j] * x[t-j]), taps before the start of t's document (or row) being zero.
CUDA tensors -> FLA's kernel; anything else -> `torch_causal_conv1d`.
"""

import torch
import torch.nn.functional as F

from .fla_varlen import fla_varlen_args


def causal_conv1d(x, weight, cu_seqlens=None, cu_seqlens_cpu=None):
    """x (B, T, D); weight (D, W) (HF's conv1d.weight (D, 1, W) squeezed); cu_seqlens int [N+1] (needs B == 1),
    with an optional host copy `cu_seqlens_cpu` that spares FLA a device-to-host sync. Returns (B, T, D) in x's
    dtype."""
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"causal_conv1d: cu_seqlens packs documents into one row, so batch size must be 1, "
                         f"got x of shape {tuple(x.shape)}; flatten the batch to (1, B*T, D) first.")
    if x.device.type != "cuda":
        return torch_causal_conv1d(x, weight, cu_seqlens)
    return _fla_causal_conv1d(x, weight, cu_seqlens, cu_seqlens_cpu)


@torch.compiler.disable  # one graph break under compile, as the FLA call in gated_delta_rule.py
def _fla_causal_conv1d(x, weight, cu_seqlens, cu_seqlens_cpu):
    from fla.modules.causal_conv1d import causal_conv1d as fla_causal_conv1d  # lazy: needs triton and a GPU

    y, _ = fla_causal_conv1d(x, weight, activation="silu", **fla_varlen_args(cu_seqlens, cu_seqlens_cpu, x.device))
    return y.to(x.dtype)


@torch.compiler.disable  # eager under compile: its check reads cu_seqlens on the host (a recompile per layout)
def torch_causal_conv1d(x, weight, cu_seqlens=None):
    """Pure torch: W shifted copies of x, each masked where its tap crosses a document start. fp32 math."""
    B, T, D = x.shape
    W = weight.shape[-1]
    t = torch.arange(T, device=x.device)
    if cu_seqlens is None:
        pos = t                                                        # (T,) position in the row
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens packs documents into one row, so batch size must be 1, got {B}.")
        cu = cu_seqlens.to(device=x.device, dtype=torch.long)
        if cu[0] != 0 or cu[-1] != T:
            raise ValueError(f"cu_seqlens must run from 0 to the sequence length {T}, got {cu.tolist()}.")
        pos = t - cu[torch.searchsorted(cu, t, right=True) - 1]        # (T,) position in the document
    dtype = torch.promote_types(x.dtype, torch.float32)
    xf, wf = x.to(dtype), weight.to(dtype)
    y = sum(F.pad(xf, (0, 0, j, 0))[:, :T] * (pos >= j)[:, None] * wf[:, W - 1 - j]  # tap j reads x[t-j]
            for j in range(W))                                        # (B, T, D)
    return F.silu(y).to(x.dtype)
