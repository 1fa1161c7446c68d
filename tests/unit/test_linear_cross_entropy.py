"""Chunked linear cross entropy (models/qwen35_moe/kernels/linear_cross_entropy.py) against torch's cross entropy on the
whole logits: the loss and the gradients of the hidden states and of the weight, with ignored labels, chunk
sizes that do not divide the token count, and through the model and the trainer's loss."""

import pytest
import torch
import torch.nn.functional as F

from models.qwen35_moe import Qwen35MoeArgs
from models.qwen35_moe.kernels.linear_cross_entropy import linear_cross_entropy_sum
from tests.builders import fp32_grad_tolerance, initialized_model


def _reference(h, weight, labels):
    return F.cross_entropy(F.linear(h, weight).float() if h.dtype != torch.float64 else F.linear(h, weight),
                           labels, ignore_index=-100, reduction="sum")


def _loss_and_grads(fn, h, weight, labels):
    h, weight = h.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = fn(h, weight, labels)
    (loss * 0.7).backward()  # a non-unit upstream gradient, as the trainer's share scaling gives
    return loss.detach(), h.grad, weight.grad


@pytest.mark.parametrize("chunk", [1, 5, 37, 100, 0])
def test_chunked_loss_and_gradients_equal_the_whole_logits_in_float64(chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[[0, 6, 7, 36]] = -100  # ignored: in the first and the last chunk, and two in a row
    got = _loss_and_grads(lambda a, b, y: linear_cross_entropy_sum(a, b, y, chunk), h, weight, labels)
    want = _loss_and_grads(_reference, h, weight, labels)
    for name, a, b in zip(["loss", "dh", "dweight"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    assert got[1][[0, 6, 7, 36]].abs().max() == 0  # ignored tokens get no gradient
    with torch.no_grad():  # the forward-only path (validation) gives the same loss
        torch.testing.assert_close(linear_cross_entropy_sum(h, weight, labels, chunk), want[0], rtol=1e-12, atol=0)


def test_bf16_chunks_stay_within_bf16_rounding_of_the_plain_path():
    """bf16 hidden states and weight, as on GPU: logits upcast to fp32 like the plain path. Gradients are compared
    with the float64 truth; an error of the chunking itself (a lost chunk, a wrong scale) would be O(1). The
    hidden states' is a bf16 matmul computed in forward and scaled by the upstream gradient in backward: rounded
    twice where the plain path rounds once, up to sqrt(2) x its error (measured 1.19x). The weight's sums the
    chunks' bf16 matmuls in fp32, one more rounding per chunk than the plain path's one matmul (measured 1.18x
    with 5 chunks; bound 1.5x)."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(300, 64, generator=g).to(torch.bfloat16)
    weight = (torch.randn(500, 64, generator=g) * 0.2).to(torch.bfloat16)
    labels = torch.randint(0, 500, (300,), generator=g)
    chunked = _loss_and_grads(lambda a, b, y: linear_cross_entropy_sum(a, b, y, 64), h, weight, labels)
    plain = _loss_and_grads(_reference, h, weight, labels)
    truth = _loss_and_grads(_reference, h.double(), weight.double(), labels)
    assert chunked[0].dtype == torch.float32
    torch.testing.assert_close(chunked[0], plain[0], rtol=1e-6, atol=0)  # same bf16 logits, fp32 sums
    for name, bound, a, b, t in zip(["dh", "dweight"], [1.42, 1.5], chunked[1:], plain[1:], truth[1:]):
        err = lambda x: ((x.double() - t).norm() / t.norm()).item()  # noqa: E731
        assert err(a) <= bound * err(b), (name, err(a), err(b))


def test_model_with_labels_gives_the_cross_entropy_of_its_logits():
    args = Qwen35MoeArgs(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,
                         linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16, shared_expert_intermediate_size=16)
    model = initialized_model(args)
    g = torch.Generator().manual_seed(2)
    ids, labels = torch.randint(0, 97, (2, 24), generator=g), torch.randint(0, 97, (2, 24), generator=g)
    labels[:, :3] = -100
    positions = torch.cat((torch.arange(10), torch.arange(14))).expand(2, 24)

    def grads():
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    logits = model(ids, positions).logits
    want = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
    want.backward()
    want_grads = grads()
    model.zero_grad()
    out = model(ids, positions, labels=labels, loss_chunk_tokens=7)
    assert out.logits is None
    out.ce_sum.backward()
    torch.testing.assert_close(out.ce_sum, want, rtol=1e-6, atol=0)
    got_grads = grads()
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:  # fp32, differing in summation order only (measured <= 4.5e-6)
        error = ((got_grads[name] - want_grads[name]).norm() / want_grads[name].norm()).item()
        assert error < fp32_grad_tolerance(name), (name, error)


def test_a_second_backward_through_the_loss_fails_instead_of_scaling_the_weight_gradient_twice():
    """The backward scales the stored weight gradient in place (no second weight-sized tensor): a second backward
    through a retained graph must then fail loudly, not return a gradient scaled twice."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(9, 8, generator=g, requires_grad=True)
    weight = torch.randn(20, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 20, (9,), generator=g)
    loss = linear_cross_entropy_sum(h, weight, labels, 4) * 0.5
    loss.backward(retain_graph=True)
    want = torch.autograd.grad(_reference(h, weight, labels) * 0.5, weight)[0]
    torch.testing.assert_close(weight.grad, want, rtol=1e-5, atol=1e-6)  # scaled once
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("chunk", [5, 0])
def test_a_scaled_sum_with_gradients_computed_ahead_equals_the_whole_logits_in_float64(chunk):
    """`scale` (the trainer's world size / label tokens, known before the forward): the result is the sum times it
    and its gradients are written already scaled, so the backward only hands them on; backpropagated with gradient
    1, as the trainer does, everything is the reference's. Any other upstream gradient is refused (on CPU the
    device-side check raises at once)."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(23, 16, generator=g, dtype=torch.float64)
    weight = torch.randn(40, 16, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 40, (23,), generator=g)
    labels[[2, 3]] = -100
    scale = torch.tensor(2 / 21)  # fp32, as the trainer's: 2 ranks over 21 label tokens

    def loss_and_grads(fn):
        x, w = h.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(x, w)
        loss.backward()
        return loss.detach(), x.grad, w.grad

    got = loss_and_grads(lambda x, w: linear_cross_entropy_sum(x, w, labels, chunk, scale=scale))
    want = loss_and_grads(lambda x, w: _reference(x, w, labels) * scale)
    for name, a, b in zip(["loss", "dh", "dweight"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    with torch.no_grad():  # evaluation: the same scaled sum
        torch.testing.assert_close(linear_cross_entropy_sum(h, weight, labels, chunk, scale=scale), got[0])
    h.requires_grad_()
    loss = linear_cross_entropy_sum(h, weight, labels, chunk, scale=scale)
    with pytest.raises(RuntimeError, match="gradient other than 1"):
        (loss * 2).backward()
    with pytest.raises(ValueError, match="fp32 0-dim"):
        linear_cross_entropy_sum(h, weight, labels, chunk, scale=scale.to(torch.bfloat16))


@pytest.mark.parametrize("scaled", [False, True])
def test_a_frozen_head_gets_no_gradient_and_its_input_the_plain_one_in_float64(scaled):
    """LoRA's frozen lm_head: no weight gradient is computed or returned, h's equals autograd's through the logits."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(37, 16, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, generator=g)  # requires_grad False
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[::5] = -100
    scale = torch.tensor(0.25) if scaled else None
    total = linear_cross_entropy_sum(h, weight, labels, chunk_tokens=8, scale=scale)
    total.backward()
    h_ref = h.detach().clone().requires_grad_(True)
    ref = F.cross_entropy(h_ref @ weight.t(), labels, ignore_index=-100, reduction="sum") * (0.25 if scaled else 1)
    ref.backward()
    torch.testing.assert_close(total, ref.to(total.dtype), rtol=1e-12, atol=0)
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-12, atol=1e-15)
    assert weight.grad is None


def test_one_chunk_of_logits_is_alive_at_a_time(monkeypatch):
    """The loss's memory is one chunk of logits (chunk x vocabulary): each chunk's logits, holding their gradient,
    are freed before the next chunk's are made. Holding the previous chunk through the next one doubles the peak
    (a 2048-token chunk of a 248k vocabulary is 0.95 GiB in bf16)."""
    import weakref

    from models.qwen35_moe.kernels import linear_cross_entropy as lce

    made, alive_at_next = [], []

    def recording(*args, **kwargs):
        alive_at_next.append(sum(ref() is not None for ref in made))
        loss, dlogits = real(*args, **kwargs)
        made.append(weakref.ref(dlogits))
        return loss, dlogits

    real = lce._chunk_loss
    monkeypatch.setattr(lce, "_chunk_loss", recording)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(40, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    linear_cross_entropy_sum(h, weight, torch.randint(0, 50, (40,), generator=g), 8).backward()
    assert alive_at_next == [0, 0, 0, 0, 0]
