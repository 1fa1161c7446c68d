"""Cross entropy of a chunk of bf16/fp16 logits on CUDA in Triton: per row, the log-sum-exp, the loss and, in place
of the logits, d loss / d logits.

The torch path (linear_cross_entropy._chunk_loss) upcasts the logits to fp32 and makes about ten passes over
them (cast, logsumexp's max / subtract / exp / sum, subtract, exp, mask, cast back): with a 248,320-token
vocabulary that is most of a step's elementwise time. Here each row is read twice (an online max and sum of
exponentials, then the softmax) and written once, in the logits' own dtype, with the same fp32 math per element.

Two entry points: `cross_entropy_rows_` for logits over the whole vocabulary (one kernel), and, for logits over a
slice of it (vocabulary-parallel, parallel/vocab_parallel.py), `vocab_slice_stats` then `softmax_grad_`, between
which the ranks combine their slices' statistics into each row's log-sum-exp. Imported only for CUDA tensors
(Triton needs a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _max_and_sum_exp(base, V, BLOCK: tl.constexpr):
    """One pass over a row of V logits: its max m and sum(exp(x - m)), in fp32 (-inf and 0 for an empty row)."""
    running_max = float("-inf")
    running_sum = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, 0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        running_max = new_max
    return running_max, running_sum


@triton.jit
def _write_softmax_grad(base, V, lse, target, keep, BLOCK: tl.constexpr):
    """Overwrite a row of V logits with (softmax(x) - one_hot(target)) * keep, softmax taken with `lse`."""
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
        grad = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * keep
        tl.store(base + cols, grad.to(base.dtype.element_ty), mask=cols < V)


@triton.jit
def _cross_entropy_rows(logits, stride, labels, loss, grad_scale, V, ignore_index, WRITE_GRAD: tl.constexpr,
                        SCALED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    label = tl.load(labels + row)
    valid = label != ignore_index
    target = tl.where(valid, label, 0)
    target_logit = tl.load(base + target).to(tl.float32)  # read before the gradient overwrites it
    running_max, running_sum = _max_and_sum_exp(base, V, BLOCK)
    lse = running_max + tl.log(running_sum)
    tl.store(loss + row, tl.where(valid, lse - target_logit, 0.0))
    if WRITE_GRAD:
        keep = tl.where(valid, 1.0, 0.0)  # ignored rows: zero
        if SCALED:
            keep = keep * tl.load(grad_scale)
        _write_softmax_grad(base, V, lse, target, keep, BLOCK)


@triton.jit
def _slice_stats(logits, stride, labels, stats, V, vocab_start, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    target = tl.load(labels + row) - vocab_start  # this slice's column of the label (elsewhere if out of range)
    here = (target >= 0) & (target < V)
    target_logit = tl.load(base + tl.where(here, target, 0), mask=here, other=0.0).to(tl.float32)
    running_max, running_sum = _max_and_sum_exp(base, V, BLOCK)
    tl.store(stats + row * 3, running_max)
    tl.store(stats + row * 3 + 1, running_sum)
    tl.store(stats + row * 3 + 2, target_logit)


@triton.jit
def _slice_softmax_grad(logits, stride, labels, lse, V, vocab_start, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    label = tl.load(labels + row)
    keep = tl.where(label != ignore_index, 1.0, 0.0)
    _write_softmax_grad(logits + row * stride, V, tl.load(lse + row), label - vocab_start, keep, BLOCK)


def _check_rows(logits: torch.Tensor) -> None:
    if logits.stride(1) != 1:
        raise ValueError("cross entropy kernel: the logits' rows must be contiguous")


def cross_entropy_rows_(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, write_grad: bool,
                        grad_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row cross entropy (fp32, 0 where labels == ignore_index) of `logits` (N, V), contiguous rows on CUDA;
    if write_grad, overwrites `logits` with d (summed loss) / d logits (softmax minus one-hot, zero rows where
    ignored), in the logits' dtype, times `grad_scale` (an fp32 device scalar) if given."""
    _check_rows(logits)
    n, vocab = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        _cross_entropy_rows[(n,)](logits, logits.stride(0), labels, loss, loss if grad_scale is None else grad_scale,
                                  vocab, ignore_index, WRITE_GRAD=write_grad, SCALED=grad_scale is not None,
                                  BLOCK=4096, num_warps=16)
    return loss


def vocab_slice_stats(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """logits (N, V_slice) of vocabulary ids vocab_start ... vocab_start + V_slice - 1 -> (N, 3) fp32 per row: the
    slice's max m, sum(exp(x - m)), and the label's logit (0 where the label is not in the slice or ignored)."""
    _check_rows(logits)
    n, vocab = logits.shape
    stats = torch.empty(n, 3, dtype=torch.float32, device=logits.device)
    if n:
        _slice_stats[(n,)](logits, logits.stride(0), labels, stats, vocab, vocab_start, BLOCK=4096, num_warps=16)
    return stats


def softmax_grad_(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, vocab_start: int,
                  ignore_index: int) -> torch.Tensor:
    """Overwrite logits (N, V_slice) with their slice of d (summed loss) / d logits: exp(x - lse) minus the one-hot
    of the label where it falls in the slice; zero rows where ignored. lse (N,) fp32, each row's log-sum-exp over
    the whole vocabulary. Returns logits."""
    _check_rows(logits)
    n, vocab = logits.shape
    if n and vocab:
        _slice_softmax_grad[(n,)](logits, logits.stride(0), labels, lse, vocab, vocab_start, ignore_index,
                                  BLOCK=4096, num_warps=16)
    return logits
