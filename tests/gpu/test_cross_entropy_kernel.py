"""The fused cross-entropy kernel (models/qwen35_moe/kernels/cross_entropy_triton.py) and the CUDA chunked linear cross
entropy built on it, against float64 references.

The kernel reads bf16 logits and does fp32 math per element, as the torch path does after its upcast: its loss
must equal the float64 loss of the same bf16 logits to fp32 rounding, and its gradient must equal the float64
softmax-minus-one-hot rounded once to bf16 (a flip of the last bit allowed: fp32 exp and a different summation
order land on the other side of a rounding boundary now and then). A vocabulary that is not a multiple of the
kernel's block, targets at both ends of it and ignored rows check the masking.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.qwen35_moe.kernels.linear_cross_entropy import linear_cross_entropy_sum

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

VOCAB = 10_007  # > 2 blocks of 4096, and not a multiple of one


def _labels(n: int, g: torch.Generator) -> torch.Tensor:
    labels = torch.randint(0, VOCAB, (n,), generator=g)
    labels[[0, 5, 6]] = -100
    labels[1], labels[2] = 0, VOCAB - 1
    return labels


def test_kernel_loss_and_gradient_equal_float64_softmax_of_the_same_logits():
    from models.qwen35_moe.kernels.cross_entropy_triton import cross_entropy_rows_

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(67, VOCAB, generator=g) * 4).to(torch.bfloat16).cuda()
    labels = _labels(67, g).cuda()
    exact = logits.double()
    valid = labels != -100
    want_loss = F.cross_entropy(exact, labels, ignore_index=-100, reduction="none")
    want_grad = torch.softmax(exact, -1) - F.one_hot(labels.clamp(min=0), VOCAB).double()
    want_grad[~valid] = 0

    loss_only = cross_entropy_rows_(logits.clone(), labels, -100, write_grad=False)
    grad = logits.clone()
    loss = cross_entropy_rows_(grad, labels, -100, write_grad=True)

    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(loss_only, loss, rtol=0, atol=0)
    assert loss[~valid].abs().max() == 0 and grad[~valid].abs().max() == 0
    rounded = want_grad.to(torch.bfloat16).double()
    torch.testing.assert_close(grad.double(), rounded, rtol=2 ** -7, atol=1e-9)  # at most a last-bit flip
    assert (grad.double() != rounded).float().mean() < 0.01  # and only now and then
    scale = torch.tensor(0.37, device="cuda")  # the gradient written already scaled (the trainer's grad_scale)
    scaled = logits.clone()
    torch.testing.assert_close(cross_entropy_rows_(scaled, labels, -100, write_grad=True, grad_scale=scale), loss,
                               rtol=0, atol=0)
    torch.testing.assert_close(scaled.double(), (want_grad * 0.37).to(torch.bfloat16).double(), rtol=2 ** -7,
                               atol=1e-9)


@pytest.mark.parametrize("chunk,scaled", [(16, False), (1000, False), (16, True)])
def test_cuda_chunked_loss_errs_no_more_than_plain_bf16(chunk, scaled):
    """linear_cross_entropy_sum on CUDA in bf16 (the kernel, fp32-accumulated weight gradient over the chunks)
    against the float64 truth, next to the plain bf16 path's error (torch's cross entropy on the whole bf16
    logits upcast to fp32, autograd through the bf16 matmul). The kernel's path rounds the logits' gradient to
    bf16 once, as the plain path does; its weight gradient is summed over the chunks in fp32 where the plain
    path's one bf16 matmul rounds the sum (measured ratio in the note of the closing commit). `scaled`: the
    gradients written already scaled by the known upstream gradient (grad_scale), rounded once all the same."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(300, 256, generator=g).to(torch.bfloat16).cuda()
    weight = (torch.randn(VOCAB, 256, generator=g) * 0.1).to(torch.bfloat16).cuda()
    labels = _labels(300, g).cuda()

    def loss_and_grads(fn, h, weight, upstream=0.7):
        h, weight = h.detach().requires_grad_(), weight.detach().requires_grad_()
        loss = fn(h, weight)
        (loss * upstream).backward()
        return loss.detach() / (0.7 / upstream), h.grad, weight.grad  # the unscaled sum

    def plain(h, weight):
        logits = h @ weight.t()
        return F.cross_entropy(logits.float() if logits.dtype != torch.float64 else logits, labels,
                               ignore_index=-100, reduction="sum")

    if scaled:  # the sum times 0.7, its gradients computed already scaled: backpropagated with 1
        scale = torch.tensor(0.7, device="cuda")
        ours = loss_and_grads(lambda a, b: linear_cross_entropy_sum(a, b, labels, chunk, scale=scale), h, weight, 1.0)
    else:
        ours = loss_and_grads(lambda a, b: linear_cross_entropy_sum(a, b, labels, chunk), h, weight)
    bf16 = loss_and_grads(plain, h, weight)
    truth = loss_and_grads(plain, h.double(), weight.double())
    assert ours[0].dtype == torch.float32 and ours[1].dtype == ours[2].dtype == torch.bfloat16
    torch.testing.assert_close(ours[0], bf16[0], rtol=1e-5, atol=0)  # the same bf16 logits, fp32 math
    for name, a, b, t in zip(["dh", "dweight"], ours[1:], bf16[1:], truth[1:]):
        err = lambda x: ((x.double() - t).norm() / t.norm()).item()  # noqa: E731
        print(f"chunk {chunk} {name}: ours {err(a):.3e} plain bf16 {err(b):.3e}")
        assert err(a) <= 1.25 * err(b), (name, err(a), err(b))
    assert ours[1][[0, 5, 6]].abs().max() == 0  # ignored tokens get no gradient
    with torch.no_grad():  # the forward-only path (validation)
        torch.testing.assert_close(linear_cross_entropy_sum(h, weight, labels, chunk), ours[0], rtol=1e-6, atol=0)


def test_vocab_slices_combine_into_the_whole_vocabulary_loss_and_gradient():
    """The vocabulary-parallel kernels (parallel/vocab_parallel.py): each of three uneven slices of the columns (one
    longer than a block, labels in each and at both ends) gives its statistics, `combine_slice_stats` makes the
    rows' log-sum-exp, and each slice writes its part of the gradient in place, through a strided view of the whole
    logits: together the float64 loss and gradient, as the one-kernel path gives them."""
    from models.qwen35_moe.kernels.cross_entropy_triton import softmax_grad_, vocab_slice_stats
    from models.qwen35_moe.kernels.linear_cross_entropy import combine_slice_stats

    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(67, VOCAB, generator=g) * 4).to(torch.bfloat16).cuda()
    labels = _labels(67, g).cuda()
    labels[3], labels[4] = 4096 + 16, 4096 + 17  # the last column of the first slice, the first of the second
    exact = logits.double()
    valid = labels != -100
    want_loss = F.cross_entropy(exact, labels, ignore_index=-100, reduction="none")
    want_grad = torch.softmax(exact, -1) - F.one_hot(labels.clamp(min=0), VOCAB).double()
    want_grad[~valid] = 0

    bounds = [0, 4096 + 17, 7000, VOCAB]
    slices = list(zip(bounds[:-1], bounds[1:]))
    grad = logits.clone()
    stats = torch.stack([vocab_slice_stats(grad[:, a:b], labels, a) for a, b in slices])
    lse, target_logit = combine_slice_stats(stats)
    loss = torch.where(valid, lse - target_logit, 0)
    for a, b in slices:
        softmax_grad_(grad[:, a:b], labels, lse, a, -100)

    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=1e-6)
    assert grad[~valid].abs().max() == 0
    rounded = want_grad.to(torch.bfloat16).double()
    torch.testing.assert_close(grad.double(), rounded, rtol=2 ** -7, atol=1e-9)  # at most a last-bit flip
    assert (grad.double() != rounded).float().mean() < 0.01


def test_vocab_parallel_on_one_nccl_rank_gives_the_plain_embedding_and_loss_without_host_syncs():
    """The vocabulary-parallel lookup and loss through NCCL on one rank (the exchanges then copy), in bf16, against
    the plain lookup and chunked loss: the same loss and gradients, and no host sync on the way."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from parallel.vocab_parallel import VocabShard

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        mesh = init_device_mesh("cuda", (1,))
        g = torch.Generator().manual_seed(3)
        table = (torch.randn(VOCAB, 256, generator=g) * 0.1).cuda()
        head = (torch.randn(VOCAB, 256, generator=g) * 0.1).cuda()
        ids = torch.randint(0, VOCAB, (2, 150), generator=g).cuda()
        labels = _labels(300, g).cuda()
        probe = torch.randn(2, 150, 256, generator=g).cuda()
        shard = VocabShard(mesh, VOCAB, torch.bfloat16)

        def step(parallel: bool):
            t, w = (torch.nn.Parameter(x.clone()) for x in (table, head))
            if parallel:
                t, w = (torch.nn.Parameter(distribute_tensor(x.detach(), mesh, [Shard(0)])) for x in (t, w))
                torch.cuda.set_sync_debug_mode("error")
                try:
                    h = shard.embed(ids, t)
                    loss = linear_cross_entropy_sum((h + probe.bfloat16()).flatten(0, 1), shard.local(w), labels, 64,
                                                    vocab=shard)
                    loss.backward()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            else:
                h = F.embedding(ids, t).bfloat16()
                loss = linear_cross_entropy_sum((h + probe.bfloat16()).flatten(0, 1), w, labels, 64)
                loss.backward()
            local = lambda x: x.to_local() if hasattr(x, "to_local") else x  # noqa: E731
            return h.detach(), loss.detach(), local(t.grad), local(w.grad)

        want, got = step(False), step(True)
        assert got[0].dtype == torch.bfloat16 and torch.equal(got[0], want[0])  # a copied row
        torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)
        for a, b in zip(got[2:], want[2:]):
            assert a.dtype == torch.float32
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    finally:
        dist.destroy_process_group()
