"""One Adam/AdamW step of one parameter in one Triton kernel (fast_adam.py): reads the fp32 parameter, gradient
and two moments once, writes the parameter and moments once, with torch's Adam math in fp32, and, if the parameter
has a kept copy in a half-precision compute dtype (models/qwen35_moe/linear.py), the new value rounded into it.
The gradient may be in that half-precision dtype too (a copy's gradient), read and upcast. CUDA only."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fast_adam import fits_kernel_dtypes


@triton.jit
def _adam_step(param, grad, exp_avg, exp_avg_sq, grad_scale, copy, n, lr, beta1, beta2, eps, weight_decay,
               step_size, bias_correction2_sqrt, DECOUPLED: tl.constexpr, SCALED: tl.constexpr,
               COPY: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    p = tl.load(param + offsets, mask=mask)
    g = tl.load(grad + offsets, mask=mask).to(tl.float32)
    m = tl.load(exp_avg + offsets, mask=mask)
    v = tl.load(exp_avg_sq + offsets, mask=mask)
    if SCALED:
        g = g / tl.load(grad_scale)
    if DECOUPLED:
        p = p * (1 - lr * weight_decay)
    else:
        g = g + weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = v * beta2 + (1 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
    tl.store(param + offsets, p, mask=mask)
    if COPY:
        tl.store(copy + offsets, p.to(copy.dtype.element_ty), mask=mask)  # round to nearest even, as torch casts
    tl.store(exp_avg + offsets, m, mask=mask)
    tl.store(exp_avg_sq + offsets, v, mask=mask)


def adam_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool,
               bias_correction1: float, bias_correction2_sqrt: float, grad_scale: torch.Tensor | None,
               copy: torch.Tensor | None = None) -> None:
    """In place on contiguous fp32 CUDA tensors of one shape (the gradient may be bf16 or fp16); `grad_scale` (a
    device scalar) divides the gradient; `copy` (bf16 or fp16, contiguous, the parameter's shape) receives the
    updated parameter rounded."""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    if not fits_kernel_dtypes(*tensors) or any(not t.is_contiguous() or t.shape != param.shape for t in tensors):
        raise ValueError(f"adam_step_: fp32 (the gradient also bf16/fp16) contiguous tensors of the parameter's "
                         f"shape {tuple(param.shape)} expected, got "
                         + ", ".join(f"{t.dtype} {tuple(t.shape)} (contiguous: {t.is_contiguous()})" for t in tensors))
    if copy is not None and (copy.dtype not in (torch.bfloat16, torch.float16) or not copy.is_contiguous()
                             or copy.shape != param.shape):
        raise ValueError(f"adam_step_: the copy must be a contiguous bf16 or fp16 tensor of shape "
                         f"{tuple(param.shape)}, got {copy.dtype} {tuple(copy.shape)}")
    n = param.numel()
    if n == 0:
        return
    block = 2048
    _adam_step[(triton.cdiv(n, block),)](
        param, grad, exp_avg, exp_avg_sq, grad_scale if grad_scale is not None else param,
        copy if copy is not None else param, n, lr, beta1, beta2, eps, weight_decay, lr / bias_correction1,
        bias_correction2_sqrt, DECOUPLED=decoupled, SCALED=grad_scale is not None, COPY=copy is not None,
        BLOCK=block, num_warps=8)
