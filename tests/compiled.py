"""What the tests that compile the debug model share: its batch shape and training step, the CUDA varlen path's
stand-in, the comparison of compiled against eager, and compiling without inductor.

One batch shape everywhere: inductor compiles CPU kernels for the shapes it is given and keeps them in its on-disk
cache, so the tests that compile the same blocks on the same shapes compile each kernel once between them (the debug
model's blocks from cold: ~25 s of C++ compilation on 2 cores; from the cache, a few)."""

import contextlib
import functools
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from parallel import activation_checkpointing
from tests.builders import fp32_grad_tolerance

BATCH, SEQ = 2, 96


def batch_ids(seed: int) -> torch.Tensor:
    """(BATCH, SEQ) token ids of the debug model's vocabulary."""
    return torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, window_size, enable_gqa=False):
    """torch's varlen_attn for equal query and key segments, per segment with SDPA; checks the ints it is given."""
    assert isinstance(max_q, int) and isinstance(max_k, int), (type(max_q), type(max_k))
    bounds = cu_q.tolist()
    assert torch.equal(cu_q, cu_k) and window_size == (-1, 0)
    assert max_q == max_k == max(b - a for a, b in zip(bounds, bounds[1:]))
    out = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                          enable_gqa=enable_gqa).transpose(0, 1)
           for a, b in zip(bounds, bounds[1:])]
    return torch.cat(out)


def packed_positions(documents: list[list[int]]) -> torch.Tensor:
    """(B, SEQ) position ids of rows packing documents of the given lengths."""
    rows = [torch.cat([torch.arange(n) for n in row]) for row in documents]
    assert all(len(r) == SEQ for r in rows)
    return torch.stack(rows)


def training_loss(out, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy plus the MoE balance loss, as training's backward sees both."""
    return F.cross_entropy(out.logits.flatten(0, 1), ids.roll(-1, dims=1).flatten()) + 0.01 * out.aux_loss


def loss_and_grads(model, ids, positions, **inputs) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward and backward (`inputs`: more of the model's arguments, e.g. a layout); the loss and gradients."""
    loss = training_loss(model(ids, positions, **inputs), ids)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return loss.item(), grads


def assert_compiled_matches_eager(compiled: tuple, eager: tuple, what) -> None:
    """(loss, gradients) of a compiled step against the eager step's: fp32 on CPU, where compiled kernels fuse and
    sum in other orders than eager ops."""
    (loss_c, grads_c), (loss, grads) = compiled, eager
    assert loss_c == pytest.approx(loss, rel=1e-6), what
    for name, grad in grads.items():
        tol = fp32_grad_tolerance(name)
        # An element's summation noise follows the magnitudes summed into it, not its own value, so the absolute
        # floor grows with the tensor's largest element: on an AVX2 host the embedding's gradient differed by
        # 1.25e-7 at a near-zero element (max |grad| 0.11), eager and compiled each 1.6e-7 from float64.
        atol = tol * max(1e-2, grad.abs().max().item())
        torch.testing.assert_close(grads_c[name], grad, rtol=tol, atol=atol, msg=f"{name} {what}")


@contextlib.contextmanager
def compiled_without_inductor(backend: str = "aot_eager"):
    """torch.compile with AOT autograd's eager backend meanwhile: the same dynamo frames and graph breaks, traced
    checkpoints and AOT forward and backward graphs as inductor's, run by eager kernels instead of generated C++ ones,
    whose compilation costs ~25 s in every process that compiles the debug model's blocks. (Under FSDP each rank
    compiles graphs of its own: measured, the FSDP run took as long after the one-process tests had filled the cache
    with the same blocks' kernels as before.) `backend="eager"` leaves AOT autograd out too, for what dynamo alone
    decides (frames, breaks)."""
    halves = activation_checkpointing._compiled  # full AC's compiled halves, made once per process
    halves.cache_clear()
    try:
        with mock.patch.object(torch, "compile", functools.partial(torch.compile, backend=backend)):
            yield
    finally:
        halves.cache_clear()
