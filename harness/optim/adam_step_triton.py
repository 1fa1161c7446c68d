"""One Adam/AdamW step of many parameters in one Triton kernel (fast_adam.py): reads the fp32 parameter, gradient
and two moments once, writes the parameter and moments once, with torch's Adam math in fp32, and, if the parameter
has a kept copy in a half-precision compute dtype (parallel/one_device_precision.py), the new value rounded into it.
The gradient may be in that half-precision dtype too (a copy's gradient), read and upcast. CUDA only."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .adam_step_inputs import KERNEL_ALIGNMENT, fits_kernel_dtypes


@triton.jit
def _adam_steps(table, n_tensors, block_tensor, block_first, grad_scale, lr, beta1, beta2, eps, weight_decay,
                step_size, bias_correction2_sqrt, GRAD: tl.constexpr, COPY: tl.constexpr, DECOUPLED: tl.constexpr,
                SCALED: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    # One program per BLOCK values of one tensor: `block_tensor` names the tensor, `block_first` its first block;
    # `table` holds, per tensor, the addresses of the parameter, gradient, moments and copy, and its size.
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    n = tl.load(table + 5 * n_tensors + t)
    start = (pid - tl.load(block_first + t)).to(tl.int64) * BLOCK
    param = _pointer(table + t, tl.float32, ALIGN) + start
    grad = _pointer(table + n_tensors + t, GRAD, ALIGN) + start
    exp_avg = _pointer(table + 2 * n_tensors + t, tl.float32, ALIGN) + start
    exp_avg_sq = _pointer(table + 3 * n_tensors + t, tl.float32, ALIGN) + start
    copy = grad  # (unused without copies)
    if COPY is not None:
        copy = _pointer(table + 4 * n_tensors + t, COPY, ALIGN) + start
    # A mask whose bound the compiler cannot know stops it vectorising: only a tensor's last block takes one.
    if start + BLOCK <= n:
        _adam_block(param, grad, exp_avg, exp_avg_sq, copy, grad_scale, lr, beta1, beta2, eps, weight_decay,
                    step_size, bias_correction2_sqrt, None, COPY, DECOUPLED, SCALED, BLOCK)
    else:
        _adam_block(param, grad, exp_avg, exp_avg_sq, copy, grad_scale, lr, beta1, beta2, eps, weight_decay,
                    step_size, bias_correction2_sqrt, tl.arange(0, BLOCK) < n - start, COPY, DECOUPLED, SCALED,
                    BLOCK)


@triton.jit
def _pointer(entry, DTYPE: tl.constexpr, ALIGN: tl.constexpr):
    # An address read from memory has no known alignment, and without one the compiler does not vectorise the
    # loads and stores (2-4x the memory instructions): ALIGN bytes, which the host has checked, is promised here.
    return tl.multiple_of(tl.load(entry).to(tl.pointer_type(DTYPE)), ALIGN)


@triton.jit
def _adam_block(param, grad, exp_avg, exp_avg_sq, copy, grad_scale, lr, beta1, beta2, eps, weight_decay, step_size,
                bias_correction2_sqrt, mask, COPY: tl.constexpr, DECOUPLED: tl.constexpr, SCALED: tl.constexpr,
                BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
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
    if COPY is not None:
        tl.store(copy + offsets, p.to(COPY), mask=mask)  # round to nearest even, as torch casts
    tl.store(exp_avg + offsets, m, mask=mask)
    tl.store(exp_avg_sq + offsets, v, mask=mask)


_BLOCK = 2048
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_block_maps: dict = {}  # (device, sizes) -> (block_tensor, block_first, blocks): the sizes of a batch do not change


def _block_map(device: torch.device, sizes: tuple[int, ...]):
    key = (device, sizes)
    if key not in _block_maps:
        blocks = torch.tensor([triton.cdiv(n, _BLOCK) for n in sizes])
        first = torch.cumsum(blocks, 0) - blocks
        owner = torch.repeat_interleave(torch.arange(len(sizes), dtype=torch.int32), blocks)
        _block_maps[key] = (owner.to(device), first.to(device), int(blocks.sum()))
    return _block_maps[key]


def adam_steps_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], copies: list[torch.Tensor] | None = None, *, lr: float,
                beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool,
                bias_correction1: float, bias_correction2_sqrt: float, grad_scale: torch.Tensor | None):
    """One Adam step of every tensor in the lists, in place, in one launch: contiguous fp32 CUDA tensors, each
    parameter with its moments of its shape; the gradients all fp32, or all bf16 or all fp16; `copies` (all bf16 or
    all fp16, or None) receive the updated parameters rounded; `grad_scale` (a device scalar) divides every
    gradient. The addresses travel in a table copied from pinned memory, so the launch costs no host sync. Returns
    the launched kernel (Triton's handle, its `.asm` the code), or None if there was nothing to do."""
    if not params:
        return None
    copies = copies if copies is not None else []
    for i, tensors in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        param = tensors[0]
        if (not fits_kernel_dtypes(*tensors) or tensors[1].dtype != grads[0].dtype
                or any(not t.is_contiguous() or t.shape != param.shape for t in tensors)):
            raise ValueError(f"adam_steps_: tensor {i}: fp32 (the gradients also all bf16 or all fp16) contiguous "
                             f"tensors of the parameter's shape {tuple(param.shape)} expected, got "
                             + ", ".join(f"{t.dtype} {tuple(t.shape)} (contiguous: {t.is_contiguous()})"
                                         for t in tensors))
    if copies and (len(copies) != len(params) or any(
            c.dtype != copies[0].dtype or c.dtype not in (torch.bfloat16, torch.float16) or not c.is_contiguous()
            or c.shape != p.shape for c, p in zip(copies, params))):
        raise ValueError("adam_steps_: the copies must be contiguous tensors of one dtype, bf16 or fp16, one per "
                         "parameter and of its shape")
    sizes = tuple(p.numel() for p in params)
    owner, first, n_blocks = _block_map(params[0].device, sizes)
    if n_blocks == 0:
        return None
    table = [t.data_ptr() for t in params] + [t.data_ptr() for t in grads] + [t.data_ptr() for t in exp_avgs]
    table += [t.data_ptr() for t in exp_avg_sqs] + ([t.data_ptr() for t in copies] or [0] * len(params))
    # (a shard's gradient may start anywhere)
    align = KERNEL_ALIGNMENT if all(address % KERNEL_ALIGNMENT == 0 for address in table) else 1
    pinned = params[0].is_cuda  # (off CUDA only under Triton's interpreter, in tests)
    table = torch.tensor(table + list(sizes), dtype=torch.int64, pin_memory=pinned).to(params[0].device,
                                                                                     non_blocking=True)
    return _adam_steps[(n_blocks,)](
        table, len(params), owner, first, grad_scale if grad_scale is not None else params[0], lr, beta1, beta2, eps,
        weight_decay, lr / bias_correction1, bias_correction2_sqrt, GRAD=_TL_DTYPES[grads[0].dtype],
        COPY=_TL_DTYPES[copies[0].dtype] if copies else None, DECOUPLED=decoupled, SCALED=grad_scale is not None,
        ALIGN=align, BLOCK=_BLOCK, num_warps=8)
