"""Depthwise causal conv + SiLU (Gated DeltaNet's short conv on q, k, v), with document resets.

out[t] = silu(sum_{j<W} weight[:, W-1-j] * x[t-j]), taps before the start of t's document (or row) being zero.
`causal_conv1d_qkv` returns the output's channels split into q, k and v: on CUDA from our Triton kernel
(kernels/causal_conv_triton.py: each part contiguous, as FLA's delta rule takes them), elsewhere from
`torch_causal_conv1d`, the reference.
"""

import torch
import torch.nn.functional as F

from ..documents import document_starts


def causal_conv1d_qkv(x, weight, parts, position_ids, cu_seqlens=None):
    """x (B, T, C); weight (C, W) (HF's conv1d.weight (C, 1, W) squeezed); parts: the channels of q, k and v
    (summing to C); position_ids: each token's position in its document, (B, T) or any shape of B * T tokens
    whose last dimension is the row length (a row always starts a document); cu_seqlens: the same documents over
    the flattened tokens (FLA's varlen convention; needs B == 1), for the torch path. Returns (q, k, v), each
    (B, T, part) in x's dtype."""
    if x.device.type != "cuda" or weight.shape[-1] > 4:  # the kernel keeps one accumulator per tap, up to 4
        return torch_causal_conv1d(x, weight, cu_seqlens).split(list(parts), dim=-1)
    from .causal_conv_triton import causal_conv_silu_qkv  # lazy: Triton needs a GPU

    tokens = x.shape[:-1]
    history = document_history(position_ids, weight.shape[-1])
    outs = causal_conv_silu_qkv(x.reshape(-1, x.shape[-1]), weight.contiguous(), history, list(parts))
    return tuple(o.view(*tokens, o.shape[-1]) for o in outs)


def document_history(position_ids: torch.Tensor, width: int) -> torch.Tensor:
    """(numel,) int32: for each token of rows of position ids (last dimension: the row), how many earlier tokens
    of its document it has, counting up to width - 1, with the document starts that cu_seqlens is derived from
    (documents.document_starts)."""
    rows = position_ids.reshape(-1, position_ids.shape[-1])
    continues = (~document_starts(rows)).to(torch.int32)  # 1 where a token is not a document start
    history, run = torch.zeros_like(continues), continues
    for back in range(1, width):  # tap `back` reaches x[t - back] if tokens t - back + 1 ... t all continue
        history = history + run
        run = run * F.pad(continues, (back, 0))[:, :rows.shape[1]]  # continues[t - back], 0 before the row
    return history.reshape(-1)


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
