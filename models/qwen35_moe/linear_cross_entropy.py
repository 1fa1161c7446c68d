"""Cross entropy of the output projection, chunk by chunk over the tokens, never holding the whole logits.

With a 248,320-token vocabulary the logits dominate a long row's memory: (tokens x vocab) in bf16, their fp32
copy and its gradient are about 10 bytes x 248,320 = 2.4 MiB per token, 38 GiB for 16k tokens. Here each chunk
of tokens computes its logits (in the hidden states' dtype, upcast to fp32 as the plain path does), its summed
cross entropy and at once its gradients with respect to the hidden states and the weight; only those gradients
are kept for backward, in fp32 (tokens x hidden, and the weight's shape accumulated over the chunks), so peak
memory is one chunk's logits. No recompute: the backward only scales the stored gradients.

On CUDA with half-precision logits a chunk's loss and logits' gradient come from one Triton kernel
(cross_entropy_kernel.py: the same fp32 math per element, the gradient written in place of the bf16 logits, no
fp32 copy), and the weight's gradient is accumulated by GEMMs with fp32 output. Elsewhere (CPU, fp32 or fp64
logits) plain torch ops compute the same, the reference the kernel is tested against.
"""

from __future__ import annotations

import torch

from .gated_delta_net_fp32 import at_least_fp32
from .linear import Linear

IGNORE_INDEX = -100


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, want_grads: bool):
    """Summed cross entropy of one chunk, and (if want_grads) d loss / d logits in the logits' compute dtype."""
    logits = h @ weight.t()
    if logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16):  # one fused kernel, same fp32 math
        from .cross_entropy_kernel import cross_entropy_rows_

        loss = cross_entropy_rows_(logits, labels, IGNORE_INDEX, write_grad=want_grads).sum()
        return loss, logits if want_grads else None
    return _torch_chunk_loss(logits, labels, want_grads, h.dtype)


def _torch_chunk_loss(logits: torch.Tensor, labels: torch.Tensor, want_grads: bool, grad_dtype: torch.dtype):
    """The reference: the logits upcast to (at least) fp32, plain torch ops."""
    logits = logits.to(at_least_fp32(logits.dtype))
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0)
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, target.unsqueeze(1)).squeeze(1)
    loss = torch.where(valid, lse - picked, 0).sum()
    if not want_grads:
        return loss, None
    probs = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the fp32 logits
    probs[torch.arange(len(target), device=probs.device), target] -= 1.0
    probs.mul_(valid.unsqueeze(1).to(probs.dtype))
    return loss, probs.to(grad_dtype)


def _matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """out = a @ b, or out += a @ b, in out's dtype. On CUDA a half-precision GEMM writes (or accumulates) straight
    into the fp32 `out` (cuBLAS' fp32 output): no rounded half-precision product, no cast, add or copy pass over
    it, and no transient of out's size (1.9 GiB for the 35B-A3B lm_head's gradient)."""
    if a.is_cuda and a.dtype != out.dtype and hasattr(torch.ops.aten.addmm, "dtype_out"):
        if accumulate:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            torch.mm(a, b, out_dtype=out.dtype, out=out)
    elif accumulate:
        out.add_(a @ b)
    else:
        out.copy_(a @ b)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk: int):
        # The weight's gradient is returned in the weight's own dtype, so an fp32 weight cast here (one GPU without
        # FSDP, linear.py) gets its fp32 gradient without a rounding to h's dtype on the way.
        ctx.dtypes = h.dtype, weight.dtype
        weight = weight.to(h.dtype)
        acc = at_least_fp32(h.dtype)
        total = torch.zeros((), dtype=acc, device=h.device)
        grad_h = torch.empty(h.shape, dtype=acc, device=h.device)  # fp32: scaled by the upstream gradient first
        # The first chunk's GEMM writes it, the others add to it (zeros if there are no tokens).
        grad_w = (torch.empty if h.shape[0] else torch.zeros)(weight.shape, dtype=acc, device=weight.device)
        for start in range(0, h.shape[0], chunk):
            hs, ys = h[start:start + chunk], labels[start:start + chunk]
            loss, dlogits = _chunk_loss(hs, weight, ys, want_grads=True)
            total += loss
            _matmul_into(grad_h[start:start + chunk], dlogits, weight, accumulate=False)
            _matmul_into(grad_w, dlogits.t(), hs, accumulate=start > 0)
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        return ((grad_h * grad_total).to(h_dtype) if ctx.needs_input_grad[0] else None,
                (grad_w * grad_total).to(w_dtype) if ctx.needs_input_grad[1] else None, None, None)


def linear_cross_entropy_sum(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             chunk_tokens: int = 1024) -> torch.Tensor:
    """sum over tokens of cross_entropy(h @ weight.T, labels), labels == -100 ignored; h (N, D), weight (V, D),
    labels (N,). Returns an fp32 scalar (fp64 for fp64 inputs). chunk_tokens <= 0: all tokens in one chunk. The
    logits are computed in h's dtype (the weight is cast to it)."""
    chunk = chunk_tokens if chunk_tokens > 0 else max(h.shape[0], 1)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, labels, chunk)
    total = torch.zeros((), dtype=at_least_fp32(h.dtype), device=h.device)
    weight = weight.to(h.dtype)
    for start in range(0, h.shape[0], chunk):
        total += _chunk_loss(h[start:start + chunk], weight, labels[start:start + chunk], want_grads=False)[0]
    return total


class LMHead(Linear):
    """The output projection: logits, or given labels the summed cross entropy above without them. The loss runs
    inside this module's call so that FSDP's hooks, which gather the weight before it and reduce its gradient
    after, frame it: the head is an FSDP unit of its own (parallel/parallelize.py)."""

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None, chunk_tokens: int = 1024) -> torch.Tensor:
        if labels is None:
            return super().forward(h)
        return linear_cross_entropy_sum(h, self.weight, labels, chunk_tokens)
