"""Cross entropy of the output projection, chunk by chunk over the tokens, never holding the whole logits.

With a 248,320-token vocabulary the logits dominate a long row's memory: (tokens x vocab) in bf16, their fp32
copy and its gradient are about 10 bytes x 248,320 = 2.4 MiB per token, 38 GiB for 16k tokens. Here each chunk
of tokens computes its logits (in the hidden states' dtype, upcast to fp32 as the plain path does), its summed
cross entropy and at once its gradients with respect to the hidden states and the weight; only those gradients
are kept for backward, in fp32 (tokens x hidden, and the weight's shape accumulated over the chunks), so peak
memory is one chunk's logits. No recompute: the backward only scales the stored gradients.

On CUDA with half-precision logits a chunk's loss and logits' gradient come from one Triton kernel
(kernels/cross_entropy_triton.py: the same fp32 math per element, the gradient written in place of the bf16 logits, no
fp32 copy), and the weight's gradient is accumulated by GEMMs with fp32 output. Elsewhere (CPU, fp32 or fp64
logits) plain torch ops compute the same, the reference the kernel is tested against.

Vocabulary-parallel (given a `vocab` shard, parallel/vocab_parallel.py): the weight is this rank's slice of the
vocabulary rows, and the hidden states and labels are gathered from every rank of the shard group, so each rank
computes its slice of every gathered token's logits. Per chunk the ranks combine their slices' (max, sum of
exponentials, label logit) into each row's log-sum-exp (one small all-gather), then each writes its slice of the
logits' gradient. The weight's gradient is then whole for the slice (every token's contribution) and the hidden
states' gradients are summed over the slices on their own rank (one reduce-scatter): the weight never travels.
"""

from __future__ import annotations

import torch

from ..fp32_contract import at_least_fp32

IGNORE_INDEX = -100
# Tokens per chunk of the loss (training.loss_chunk_tokens' default). A chunk holds 2 B x vocabulary per token on
# CUDA (bf16 logits, their gradient written in place: 1.9 GiB for 4096 tokens of 248k); 4096 ran 1.040x 1024's
# tokens/s and 1.015x 2048's, at 8 layers / 32 experts of 35B-A3B's widths (docs/performance.md, "The loss chunk"):
# fewer, larger lm_head GEMMs, and fewer passes of the weight gradient's fp32 accumulation.
CHUNK_TOKENS = 4096


def _use_kernel(logits: torch.Tensor) -> bool:
    return logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16)


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, want_grads: bool, vocab=None,
                grad_scale: torch.Tensor | None = None):
    """Cross entropy of each row of one chunk (fp32), and (if want_grads) d loss / d logits (times grad_scale if
    given) in the logits' compute dtype. `vocab`: the vocabulary-parallel shard whose slice of the rows `weight`
    holds (None: all of them)."""
    logits = h @ weight.t()
    if vocab is not None:
        return _slice_chunk_loss(logits, labels, want_grads, h.dtype, vocab)
    if _use_kernel(logits):  # one fused kernel, same fp32 math
        from .cross_entropy_triton import cross_entropy_rows_

        loss = cross_entropy_rows_(logits, labels, IGNORE_INDEX, write_grad=want_grads, grad_scale=grad_scale)
        return loss, logits if want_grads else None
    return _torch_chunk_loss(logits, labels, want_grads, h.dtype, grad_scale)


def _torch_chunk_loss(logits: torch.Tensor, labels: torch.Tensor, want_grads: bool, grad_dtype: torch.dtype,
                      grad_scale: torch.Tensor | None = None):
    """The reference: the logits upcast to (at least) fp32, plain torch ops."""
    logits = logits.to(at_least_fp32(logits.dtype))
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0)
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, target.unsqueeze(1)).squeeze(1)
    loss = torch.where(valid, lse - picked, 0)
    return loss, _torch_softmax_grad(logits, labels, lse, 0, grad_dtype, grad_scale) if want_grads else None


def _label_column(labels: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each label's column among vocabulary ids start ... start + width - 1 (0 where it is not among them), and
    whether it is (never for an ignored label, -100)."""
    local = labels - start
    here = (local >= 0) & (local < width)
    return torch.where(here, local, 0), here


def _torch_softmax_grad(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, start: int,
                        grad_dtype: torch.dtype, grad_scale: torch.Tensor | None = None) -> torch.Tensor:
    """d (summed loss) / d logits, for upcast logits over vocabulary ids start ... (overwritten): the softmax taken
    with each row's log-sum-exp `lse`, minus the label's one-hot where the label falls among them; zero rows where
    ignored; times grad_scale if given. The reference of the kernels' gradients."""
    probs = logits.sub_(lse.unsqueeze(1)).exp_()
    column, here = _label_column(labels, start, probs.shape[1])
    probs[torch.arange(len(labels), device=probs.device), column] -= here.to(probs.dtype)
    keep = (labels != IGNORE_INDEX).unsqueeze(1).to(probs.dtype)
    probs.mul_(keep if grad_scale is None else keep * grad_scale.to(probs.dtype))
    return probs.to(grad_dtype)


def _slice_chunk_loss(logits: torch.Tensor, labels: torch.Tensor, want_grads: bool, grad_dtype: torch.dtype, vocab):
    """_chunk_loss of logits over vocabulary ids vocab.start ... (this rank's slice): the ranks' per-row slice
    statistics are combined by `vocab.combine` into the whole vocabulary's log-sum-exp and label logit."""
    kernel = _use_kernel(logits)
    if kernel:
        from .cross_entropy_triton import softmax_grad_, vocab_slice_stats

        stats = vocab_slice_stats(logits, labels, vocab.start)
    else:
        logits = logits.to(at_least_fp32(logits.dtype))
        stats = _torch_slice_stats(logits, labels, vocab.start)
    lse, target_logit = vocab.combine(stats)
    valid = labels != IGNORE_INDEX
    loss = torch.where(valid, lse - target_logit, 0)
    if not want_grads:
        return loss, None
    if kernel:
        return loss, softmax_grad_(logits, labels, lse, vocab.start, IGNORE_INDEX)
    return loss, _torch_softmax_grad(logits, labels, lse, vocab.start, grad_dtype)


def _torch_slice_stats(logits: torch.Tensor, labels: torch.Tensor, start: int) -> torch.Tensor:
    """(N, 3): each row's max m over the slice, sum(exp(x - m)), and the label's logit where the label is in the
    slice (else 0). The reference of cross_entropy_kernel.vocab_slice_stats."""
    top = logits.amax(1)
    sums = (logits - top.unsqueeze(1)).exp().sum(1)
    column, here = _label_column(labels, start, logits.shape[1])
    picked = logits.gather(1, column.unsqueeze(1)).squeeze(1)
    return torch.stack((top, sums, torch.where(here, picked, 0)), dim=1)


def combine_slice_stats(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """stats (slices, N, 3), each slice's (max, sum of exponentials, label logit) per row -> each row's log-sum-exp
    over all the slices and its label's logit."""
    top = stats[..., 0].amax(0)
    total = (stats[..., 1] * (stats[..., 0] - top).exp()).sum(0)
    return top + total.log(), stats[..., 2].sum(0)


def scale_(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """t *= scale (a 0-dim tensor), in place. As a foreach op: `t.mul_(scale)` with a CUDA scale broadcasts it as a
    stride-0 operand, which takes the unvectorised kernel, well short of the bandwidth over the 35B-A3B lm_head's
    fp32 gradient (docs/performance.md, "Tried, not kept")."""
    torch._foreach_mul_([t], scale)
    return t


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


def _chunked(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int, want_grads: bool, vocab,
             grad_scale: torch.Tensor | None = None):
    """The summed cross entropy of h's rows and, if want_grads, its gradients with respect to h and the weight (fp32,
    at least; times grad_scale if given), chunk by chunk: each chunk's logits' gradient is consumed at once by two
    GEMMs. Under a `vocab` shard the rows are first gathered from the shard group, and the loss and h's gradient
    are this rank's rows'."""
    if vocab is not None:  # chunks of as many logits as without the shard
        h, labels, chunk = vocab.gather(h), vocab.gather(labels), chunk * vocab.size
    acc = at_least_fp32(h.dtype)
    losses = torch.empty(h.shape[0], dtype=acc, device=h.device)
    grad_h = grad_w = None
    if want_grads:
        grad_h = torch.empty(h.shape, dtype=acc, device=h.device)  # fp32: scaled by the upstream gradient first
        # The first chunk's GEMM writes it, the others add to it (zeros if there are no tokens).
        grad_w = (torch.empty if h.shape[0] else torch.zeros)(weight.shape, dtype=acc, device=weight.device)
    for start in range(0, h.shape[0], chunk):
        hs, ys = h[start:start + chunk], labels[start:start + chunk]
        losses[start:start + chunk], dlogits = _chunk_loss(hs, weight, ys, want_grads, vocab, grad_scale)
        if want_grads:
            _matmul_into(grad_h[start:start + chunk], dlogits, weight, accumulate=False)
            _matmul_into(grad_w, dlogits.t(), hs, accumulate=start > 0)
        del dlogits  # freed before the next chunk's logits are made: one chunk's alive at a time, not two
    if vocab is None:
        return losses.sum(), grad_h, grad_w
    return vocab.own(losses).sum(), None if grad_h is None else vocab.scatter_sum(grad_h), grad_w


def _in_dtype(weight: torch.Tensor, given: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The weight in `dtype`: the caller's tensor of it in that dtype if given, else a cast."""
    return given if given is not None and given.dtype == dtype else weight.to(dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, chunk: int, vocab, scale, weight_in_h_dtype):
        # The weight's gradient is returned in the weight's own dtype, so an fp32 weight read in h's dtype gets its
        # fp32 gradient without a rounding to h's dtype on the way.
        ctx.dtypes, ctx.vocab, ctx.scaled = (h.dtype, weight.dtype), vocab, scale is not None
        w = _in_dtype(weight, weight_in_h_dtype, h.dtype)
        total, grad_h, grad_w = _chunked(h, w, labels, chunk, True, vocab, scale)
        ctx.save_for_backward(grad_h, grad_w)
        return total if scale is None else total * scale

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        if ctx.scaled:  # the gradients are already those of the scaled sum: check the sum's own is 1, no sync
            torch._assert_async(grad_total == 1, "linear_cross_entropy_sum: a scaled sum was backpropagated with "
                                "a gradient other than 1 (scale it through `scale` instead)")
        else:
            # Scaled in place: a copy would be a second weight-sized fp32 tensor (2 GiB for 35B-A3B's lm_head) at the
            # start of the backward, when the activations are all alive. (A second backward through the graph fails
            # autograd's check that saved tensors were not modified.) Under a vocab shard the weight's gradient holds
            # every rank's tokens: the shard averages it over the mesh.
            grad_w = scale_(grad_w, grad_total) if ctx.vocab is None else ctx.vocab.weight_grad(grad_w, grad_total)
            grad_h = grad_h * grad_total
        return (grad_h.to(h_dtype) if ctx.needs_input_grad[0] else None,
                grad_w.to(w_dtype) if ctx.needs_input_grad[1] else None, None, None, None, None, None)


def linear_cross_entropy_sum(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             chunk_tokens: int = CHUNK_TOKENS, vocab=None, scale: torch.Tensor | None = None,
                             weight_in_h_dtype: torch.Tensor | None = None) -> torch.Tensor:
    """sum over tokens of cross_entropy(h @ weight.T, labels), labels == -100 ignored; h (N, D), weight (V, D),
    labels (N,). Returns an fp32 scalar (fp64 for fp64 inputs). chunk_tokens <= 0: all tokens in one chunk. The
    logits are computed in h's dtype (the weight is cast to it).

    `vocab`: a vocabulary-parallel shard (parallel/vocab_parallel.py) and `weight` its slice of the rows (a plain
    tensor): the loss of this rank's tokens. Every rank of the shard group calls it with as many tokens.

    `scale`: an fp32 0-dim tensor known before the forward (the trainer's: world size / global label tokens):
    the result is the sum times `scale`, and the logits' gradients are written already scaled, so the backward
    hands the stored gradients on without a scaling pass over the weight's (a read and write of the lm_head's
    fp32 gradient, 2 GiB at 35B-A3B). Backpropagate it with gradient 1 (as a term of the loss being
    backpropagated): the backward checks that on the device, without a host sync (otherwise a device-side
    assert). Not with `vocab`, where the caller multiplies the sum instead.

    `weight_in_h_dtype`: the weight's values in h's dtype, if the caller holds them: read in place of a cast of the
    weight (the gradient still goes to `weight`, in its dtype)."""
    chunk = chunk_tokens if chunk_tokens > 0 else max(h.shape[0], 1)
    if scale is not None and (vocab is not None or scale.dtype != torch.float32 or scale.ndim):
        raise ValueError(f"linear_cross_entropy_sum: scale must be an fp32 0-dim tensor and vocab None, got "
                         f"{scale.dtype} of shape {tuple(scale.shape)} and vocab {vocab}")
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, labels, chunk, vocab, scale, weight_in_h_dtype)
    total = _chunked(h, _in_dtype(weight, weight_in_h_dtype, h.dtype), labels, chunk, False, vocab)[0]
    return total if scale is None else total * scale
