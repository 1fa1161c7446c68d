"""The torch causal depthwise conv + SiLU against torch.nn.functional.conv1d, with document resets.

Runs in fp64: both sides sum the same W products in a different order, so they differ by rounding
alone (~1e-16); 1e-12 catches any misplaced tap (which moves outputs by ~1e-1)."""

import pytest
import torch
import torch.nn.functional as F

from models.qwen35_moe.kernels.causal_conv import causal_conv1d_qkv, torch_causal_conv1d

FP64_TOL = dict(rtol=1e-12, atol=1e-12)
D, W = 5, 4


def reference_conv(x, weight):
    """Depthwise conv1d padded by W-1 and truncated to T (what HF's causal_conv1d_fn does), then SiLU."""
    T = x.shape[1]
    y = F.conv1d(x.transpose(1, 2), weight[:, None, :], padding=weight.shape[-1] - 1, groups=x.shape[-1])
    return F.silu(y[..., :T]).transpose(1, 2)  # (B, T, D)


def make_inputs(B, T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(D, W, generator=gen, dtype=torch.float64, requires_grad=True)
    return x, weight


def test_matches_depthwise_conv1d_on_rows():
    x, weight = make_inputs(3, 20)
    torch.testing.assert_close(torch_causal_conv1d(x, weight), reference_conv(x, weight), **FP64_TOL)


def test_packed_documents_match_each_document_run_alone_forward_and_backward():
    cu = [0, 1, 3, 10, 22]  # documents shorter than, and longer than, the kernel width W = 4
    x, weight = make_inputs(1, cu[-1])
    do = torch.randn(1, cu[-1], D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = torch_causal_conv1d(x, weight, torch.tensor(cu))
    dx, dw = torch.autograd.grad(y, (x, weight), do)
    expected_y = torch.cat([reference_conv(x[:, a:b], weight) for a, b in zip(cu, cu[1:])], 1)
    expected_dx, expected_dw = torch.autograd.grad(expected_y, (x, weight), do)
    torch.testing.assert_close(y, expected_y, **FP64_TOL)
    torch.testing.assert_close(dx, expected_dx, **FP64_TOL)
    torch.testing.assert_close(dw, expected_dw, **FP64_TOL)


def test_gradients_pass_gradcheck():
    x, weight = make_inputs(1, 9)
    assert torch.autograd.gradcheck(lambda x, w: torch_causal_conv1d(x, w, torch.tensor([0, 2, 9])), (x, weight))


def test_causal_conv1d_qkv_on_cpu_is_the_reference_split_in_the_input_dtype():
    x, weight = (t.detach().to(torch.bfloat16) for t in make_inputs(1, 12))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    q, k, v = causal_conv1d_qkv(x, weight, (1, 1, 3), positions, torch.tensor([0, 5, 12]))
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16
    assert (q.shape[-1], k.shape[-1], v.shape[-1]) == (1, 1, 3)
    torch.testing.assert_close(torch.cat((q, k, v), -1), torch_causal_conv1d(x, weight, torch.tensor([0, 5, 12])))


def test_cu_seqlens_with_batch_larger_than_one_is_refused():
    x, weight = make_inputs(2, 6)
    with pytest.raises(ValueError, match="batch size must be 1"):
        causal_conv1d_qkv(x, weight, (1, 1, 3), torch.arange(6).expand(2, 6), torch.tensor([0, 6, 12]))


def test_document_history_counts_each_tokens_earlier_tokens_in_its_document_from_cu_seqlens():
    """The CUDA kernel's document resets (document_history) against the cu_seqlens documents.py derives from the
    same position ids: rows starting mid-document, documents of 1 and 2 tokens, a row shorter than the width."""
    from models.qwen35_moe.documents import document_layout
    from models.qwen35_moe.kernels.causal_conv import document_history

    for positions in (torch.tensor([[5, 6, 7, 0, 1, 2, 3, 4, 0, 0, 1], [0, 1, 2, 3, 0, 1, 0, 0, 9, 10, 11]]),
                      torch.tensor([[3, 4], [0, 0]])):
        cu = document_layout(positions, *positions.shape, torch.device("cpu")).cu_seqlens.tolist()
        expected = [min(t - max(c for c in cu if c <= t), W - 1) for t in range(positions.numel())]
        assert document_history(positions, W).tolist() == expected
