"""Cross entropy of a chunk of bf16/fp16 logits on CUDA in one Triton kernel: per row, the log-sum-exp, the loss
and, in place of the logits, d loss / d logits.

The torch path (linear_cross_entropy._chunk_loss) upcasts the logits to fp32 and makes about ten passes over
them (cast, logsumexp's max / subtract / exp / sum, subtract, exp, mask, cast back): with a 248,320-token
vocabulary that is most of a step's elementwise time. Here each row is read twice (an online max and sum of
exponentials, then the softmax) and written once, in the logits' own dtype, with the same fp32 math per element.
Imported only for CUDA tensors (Triton needs a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _cross_entropy_rows(logits, stride, labels, loss, V, ignore_index, WRITE_GRAD: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    label = tl.load(labels + row)
    valid = label != ignore_index
    target = tl.where(valid, label, 0)
    target_logit = tl.load(base + target).to(tl.float32)  # read before the gradient overwrites it
    running_max = float("-inf")
    running_sum = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, 0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    tl.store(loss + row, tl.where(valid, lse - target_logit, 0.0))
    if WRITE_GRAD:
        keep = tl.where(valid, 1.0, 0.0)  # ignored rows get a zero gradient
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
            grad = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * keep
            tl.store(base + cols, grad.to(logits.dtype.element_ty), mask=cols < V)


def cross_entropy_rows_(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                        write_grad: bool) -> torch.Tensor:
    """Per-row cross entropy (fp32, 0 where labels == ignore_index) of `logits` (N, V), contiguous rows on CUDA;
    if write_grad, overwrites `logits` with d (summed loss) / d logits (softmax minus one-hot, zero rows where
    ignored), in the logits' dtype."""
    if logits.stride(1) != 1:
        raise ValueError("cross_entropy_rows_: the logits' rows must be contiguous")
    n, vocab = logits.shape
    loss = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        _cross_entropy_rows[(n,)](logits, logits.stride(0), labels, loss, vocab, ignore_index,
                                  WRITE_GRAD=write_grad, BLOCK=4096, num_warps=16)
    return loss
