"""Gated DeltaNet's causal conv + SiLU on CUDA in Triton, writing q, k and v as separate contiguous tensors.

    y[t, c] = silu(sum_{j<W} weight[c, W-1-j] * x[t-j, c]),   taps that leave t's document (or row) read zero

FLA's kernel (0.6) recomputes the forward in its backward, which takes several times what moving its bytes once
would (benchmarks/tools/causal_conv.py prints both); and its output, one (T, C) tensor, reaches FLA's delta rule as
three strided views that FLA copies to contiguous q, k and v. Ours is ahead end to end (docs/performance.md,
"Hand-written pieces against the libraries"). Here:
- the forward writes each part of the channels (q, k, v) to its own contiguous tensor;
- the backward reads their gradients where FLA left them and recomputes the pre-activations from x: one kernel
  per part writes dz = dy * silu'(z) (fp32), one kernel reads dz's shifted rows for dx and the per-block
  partial weight gradients (summed after; no atomics, so deterministic);
- document starts come from the position ids (a token starts a document where its position is 0, and every row
  starts one), as models/qwen35_moe/documents.py derives cu_seqlens from them, passed as each token's count of
  earlier tokens in its document (causal_conv.document_history): no host-side index and no division in the
  kernels, so the op has static shapes and a compiled block keeps it in its graph (torch.library.triton_op).
Math in fp32, rounded once to the input's dtype. Imported only for CUDA tensors (Triton needs a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

ROWS_PER_BACKWARD_PROGRAM = 256  # fixed, so the partial weight gradients' shape does not depend on the tiles


def _configs(*tiles: tuple[int, int, int]) -> list[triton.Config]:
    # (BLOCK_T rows, BLOCK_C columns, warps) per tile; picked per width on first use (a few compiles, then cached).
    return [triton.Config({"BLOCK_T": t, "BLOCK_C": c}, num_warps=w) for t, c, w in tiles]


ELEMENTWISE_TILES = _configs((16, 128, 2), (16, 256, 4), (32, 64, 2), (32, 128, 4))


@triton.jit
def _preactivation(x, history, weight, rows, in_t, x_cols, in_c, channels, W: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    """The conv before the SiLU at `rows` and columns `x_cols` of x, in fp32."""
    back = tl.load(history + rows, mask=in_t, other=-1)  # tap j reads x[t - j] if j <= back (same document)
    z = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W):
        w = tl.load(weight + x_cols * W + (W - 1 - j), mask=in_c, other=0.0).to(tl.float32)
        xj = tl.load(x + (rows - j)[:, None] * channels + x_cols[None, :], mask=(j <= back)[:, None] & in_c[None, :],
                     other=0.0).to(tl.float32)
        z += xj * w[None, :]
    return z


@triton.autotune(ELEMENTWISE_TILES, key=["C", "W"])
@triton.jit
def _conv_silu_forward(x, history, weight, y, N, channels, col0, C, W: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    # Program (row block, column block) of one part: columns col0 ... col0 + C - 1 of x, all of y's.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_t, in_c = rows < N, cols < C
    z = _preactivation(x, history, weight, rows, in_t, col0 + cols, in_c, channels, W, BLOCK_T, BLOCK_C)
    tl.store(y + rows[:, None] * C + cols[None, :], (z * tl.sigmoid(z)).to(y.dtype.element_ty),
             mask=in_t[:, None] & in_c[None, :])


@triton.autotune(ELEMENTWISE_TILES, key=["C", "W"])
@triton.jit
def _conv_silu_output_grad(x, history, weight, dy, dz, N, channels, col0, C, W: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    # dz = dy * silu'(z), z the recomputed pre-activation: one part's columns, written to dz (fp32, all columns).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_t, in_c = rows < N, cols < C
    mask = in_t[:, None] & in_c[None, :]
    z = _preactivation(x, history, weight, rows, in_t, col0 + cols, in_c, channels, W, BLOCK_T, BLOCK_C)
    g = tl.load(dy + rows[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(z)
    tl.store(dz + rows[:, None] * channels + (col0 + cols)[None, :], g * sig * (1 + z * (1 - sig)), mask=mask)


@triton.autotune(_configs((8, 128, 2), (16, 64, 2), (16, 128, 4), (32, 64, 4)), key=["channels", "W"])
@triton.jit
def _conv_transpose(x, history, weight, dz, dx, dw_partial, N, channels, W: tl.constexpr, ROWS: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    # Program (block of ROWS rows, column block): dx[t] = sum_j w_j * dz[t + j] over the outputs t + j whose tap
    # j reaches back to t, and the block's partial weight gradient sum_t dz[t + j] * x[t] per tap j.
    tl.static_assert(W <= 4)  # one accumulator per tap below
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = cols < channels
    acc0 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for tile in range(ROWS // BLOCK_T):
        rows = (tl.program_id(0).to(tl.int64) * ROWS + tile * BLOCK_T) + tl.arange(0, BLOCK_T)
        in_t = rows < N
        x_t = tl.load(x + rows[:, None] * channels + cols[None, :], mask=in_t[:, None] & in_c[None, :],
                      other=0.0).to(tl.float32)
        dx_t = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(W):
            s = rows + j
            back = tl.load(history + s, mask=s < N, other=-1)  # output s's tap j reaches t if j <= back
            g = tl.load(dz + s[:, None] * channels + cols[None, :], mask=(j <= back)[:, None] & in_c[None, :],
                        other=0.0)
            w = tl.load(weight + cols * W + (W - 1 - j), mask=in_c, other=0.0).to(tl.float32)
            dx_t += g * w[None, :]
            if j == 0:
                acc0 += g * x_t
            if j == 1:
                acc1 += g * x_t
            if j == 2:
                acc2 += g * x_t
            if j == 3:
                acc3 += g * x_t
        tl.store(dx + rows[:, None] * channels + cols[None, :], dx_t.to(dx.dtype.element_ty),
                 mask=in_t[:, None] & in_c[None, :])
    out = dw_partial + (tl.program_id(0) * channels + cols) * W + W - 1  # tap j's column is W - 1 - j
    tl.store(out, tl.sum(acc0, 0), mask=in_c)
    if W > 1:
        tl.store(out - 1, tl.sum(acc1, 0), mask=in_c)
    if W > 2:
        tl.store(out - 2, tl.sum(acc2, 0), mask=in_c)
    if W > 3:
        tl.store(out - 3, tl.sum(acc3, 0), mask=in_c)


def _check(x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor, parts: list[int]) -> None:
    if (x.dim() != 2 or not x.is_contiguous() or weight.shape != (x.shape[1], weight.shape[-1])
            or not weight.is_contiguous() or history.shape != (x.shape[0],) or sum(parts) != x.shape[1]):
        raise ValueError(f"causal conv kernel: contiguous x (N, C), weight (C, W) and history (N,) with parts "
                         f"summing to C expected, got x {tuple(x.shape)}, weight {tuple(weight.shape)}, history "
                         f"{tuple(history.shape)}, parts {parts}")


def _part_starts(parts: list[int]) -> list[int]:
    return [sum(parts[:i]) for i in range(len(parts))]


def _part_grid(n: int, c: int):
    """The grid of a per-part kernel: row blocks x column blocks of the part's c columns."""
    return lambda meta: (triton.cdiv(n, meta["BLOCK_T"]), triton.cdiv(c, meta["BLOCK_C"]))


@triton_op("qwen35::causal_conv_silu_qkv", mutates_args=())
def causal_conv_silu_qkv(x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor,
                         parts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (N, C) tokens, weight (C, W), history (N,) int32 how many earlier tokens of its document each token has
    (at least W - 1 counts as W - 1; causal_conv.document_history) -> the conv + SiLU of x's channels split into
    three parts of `parts` channels, each (N, part) contiguous, in x's dtype."""
    _check(x, weight, history, parts)
    n, width = x.shape[0], weight.shape[1]
    outs = []
    for col0, c in zip(_part_starts(parts), parts):
        y = torch.empty(n, c, dtype=x.dtype, device=x.device)
        if n and c:
            wrap_triton(_conv_silu_forward)[_part_grid(n, c)](x, history, weight, y, n, x.shape[1], col0, c, W=width)
        outs.append(y)
    return tuple(outs)


@triton_op("qwen35::causal_conv_silu_qkv_backward", mutates_args=())
def causal_conv_silu_qkv_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, x: torch.Tensor,
                                  weight: torch.Tensor, history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx (N, C) in x's dtype, dweight (C, W) in weight's dtype) of causal_conv_silu_qkv, given its three
    outputs' gradients."""
    n, width = x.shape[0], weight.shape[1]
    parts = [dq.shape[1], dk.shape[1], dv.shape[1]]
    _check(x, weight, history, parts)
    dz = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for col0, c, dy in zip(_part_starts(parts), parts, (dq, dk, dv)):
        if n and c:
            wrap_triton(_conv_silu_output_grad)[_part_grid(n, c)](x, history, weight, dy.contiguous(), dz, n,
                                                                  x.shape[1], col0, c, W=width)
    dx = torch.empty_like(x)
    blocks = triton.cdiv(n, ROWS_PER_BACKWARD_PROGRAM)
    dw_partial = torch.empty(blocks, x.shape[1], width, dtype=torch.float32, device=x.device)
    if n:
        grid = lambda meta: (blocks, triton.cdiv(x.shape[1], meta["BLOCK_C"]))  # noqa: E731
        wrap_triton(_conv_transpose)[grid](x, history, weight, dz, dx, dw_partial, n, x.shape[1], W=width,
                                           ROWS=ROWS_PER_BACKWARD_PROGRAM)
    return dx, dw_partial.sum(0).to(weight.dtype)


def _setup_context(ctx, inputs, output):
    x, weight, history, parts = inputs
    ctx.save_for_backward(x, weight, history)
    ctx.parts = list(parts)


def _backward(ctx, dq, dk, dv):
    x, weight, history = ctx.saved_tensors
    grads = [torch.zeros(x.shape[0], c, dtype=x.dtype, device=x.device) if g is None else g
             for g, c in zip((dq, dk, dv), ctx.parts)]  # an unused output has no gradient
    dx, dweight = causal_conv_silu_qkv_backward(*grads, x, weight, history)
    return dx, dweight, None, None


causal_conv_silu_qkv.register_autograd(_backward, setup_context=_setup_context)
