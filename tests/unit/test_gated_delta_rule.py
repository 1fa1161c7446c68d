"""The torch chunked gated delta rule against the token-by-token recurrence, and the recurrence against
transformers' independent implementation.

Chunked vs naive runs in fp64: the two are exact reformulations of one recurrence, so they differ by
rounding alone (observed ~1e-15); 1e-10 leaves room for the triangular solve's error growth and still
catches any real mistake (a wrong decay or a missed reset moves outputs by > 1e-2)."""

import inspect

import pytest
import torch
import torch.nn.functional as F

from models.qwen35_moe.kernels.gated_delta_rule import (
    gated_delta_rule,
    naive_recurrent_gated_delta_rule,
    torch_chunk_gated_delta_rule,
)

FP64_TOL = dict(rtol=1e-10, atol=1e-10)
HK, HV, DK, DV = 2, 4, 8, 6  # Hv = 2 Hk exercises GVA; Dk != Dv catches transposed states


def make_inputs(B, T, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=dtype)
    q, k, v = randn(B, T, HK, DK), randn(B, T, HK, DK), randn(B, T, HV, DV)
    g = F.logsigmoid(randn(B, T, HV) + 2.0)  # decays from ~0.98 to ~0.1 per token: state lives across chunks
    beta = randn(B, T, HV).sigmoid()
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def output_and_grads(fn, inputs, **kwargs):
    o = fn(*inputs, **kwargs)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=o.dtype)
    return [o, *torch.autograd.grad(o, inputs, do)]  # o, dq, dk, dv, dg, dbeta


def assert_all_close(actual, expected, **tol):
    for name, a, e in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], actual, expected):
        torch.testing.assert_close(a, e, **tol, msg=lambda m: f"{name}: {m}")


CASES = {
    "one_document_odd_length": (1, 77, None),
    "batch_of_rows": (3, 45, None),
    # lengths 1, 16 (one 16-chunk), 33, 64 (one 64-chunk), 36: starts both on and off chunk boundaries
    "packed_documents": (1, 150, [0, 1, 17, 50, 114, 150]),
}


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
@pytest.mark.parametrize("case", CASES)
def test_chunked_matches_naive_recurrence_forward_and_backward(case, chunk_size):
    B, T, cu = CASES[case]
    cu_seqlens = None if cu is None else torch.tensor(cu)
    inputs = make_inputs(B, T)
    expected = output_and_grads(naive_recurrent_gated_delta_rule, inputs, cu_seqlens=cu_seqlens)
    actual = output_and_grads(torch_chunk_gated_delta_rule, inputs, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    assert_all_close(actual, expected, **FP64_TOL)


def test_packed_documents_match_each_document_run_alone():
    cu = [0, 30, 31, 100, 130]
    inputs = make_inputs(1, cu[-1])
    do = torch.randn(1, cu[-1], HV, DV, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    o = torch_chunk_gated_delta_rule(*inputs, cu_seqlens=torch.tensor(cu), chunk_size=16)
    packed = [o, *torch.autograd.grad(o, inputs, do)]
    for a, b in zip(cu, cu[1:]):
        alone = [x[:, a:b].detach().requires_grad_() for x in inputs]
        o_alone = torch_chunk_gated_delta_rule(*alone, chunk_size=16)
        expected = [o_alone, *torch.autograd.grad(o_alone, alone, do[:, a:b])]
        assert_all_close([x[:, a:b] for x in packed], expected, **FP64_TOL)


@pytest.mark.parametrize("fn", [torch_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule])
def test_document_boundary_resets_state(fn):
    cu = torch.tensor([0, 40, 90])
    inputs = [x.detach() for x in make_inputs(1, 90)]
    perturbed = [x.clone() for x in inputs]
    for x in perturbed:
        x[:, :40] = x[:, :40].flip(1) * 0.5  # a different first document, same second one
    o, o_perturbed = fn(*inputs, cu_seqlens=cu), fn(*perturbed, cu_seqlens=cu)
    torch.testing.assert_close(o_perturbed[:, 40:], o[:, 40:], rtol=0, atol=1e-12)
    # The test has teeth: document 1 did change, and without the reset it would leak into document 2.
    assert (o_perturbed[:, :40] - o[:, :40]).abs().max() > 1e-2
    assert (fn(*perturbed)[:, 40:] - fn(*inputs)[:, 40:]).abs().max() > 1e-4


def test_naive_recurrence_matches_transformers_recurrent_reference():
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

    hf_recurrent = inspect.unwrap(hf.torch_recurrent_gated_delta_rule)  # unwrapped: transformers would call FLA
    inputs = [x.detach() for x in make_inputs(1, 70)]
    expected, _ = hf_recurrent(*inputs, use_qk_l2norm_in_kernel=True)
    # transformers computes in fp32 whatever the input dtype: fp32 rounding over 70 steps bounds the gap.
    torch.testing.assert_close(naive_recurrent_gated_delta_rule(*inputs), expected.double(), rtol=1e-5, atol=1e-5)


def test_chunked_matches_transformers_chunked_reference_in_fp32():
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

    hf_chunked = inspect.unwrap(hf.torch_chunk_gated_delta_rule)
    inputs = [x.detach() for x in make_inputs(1, 150, dtype=torch.float32)]
    expected, _ = hf_chunked(*inputs, use_qk_l2norm_in_kernel=True)
    # Same math in fp32, differently ordered: fp32 rounding only.
    torch.testing.assert_close(torch_chunk_gated_delta_rule(*inputs), expected, rtol=1e-5, atol=1e-5)


def test_gated_delta_rule_on_cpu_is_the_torch_chunked_form_in_the_input_dtype():
    inputs = [x.detach().to(torch.bfloat16) for x in make_inputs(1, 50)]
    inputs[3] = inputs[3].float()  # g stays fp32, as the model computes it
    o = gated_delta_rule(*inputs, cu_seqlens=torch.tensor([0, 20, 50]))
    assert o.dtype == torch.bfloat16 and o.shape == (1, 50, HV, DV)
    torch.testing.assert_close(o, torch_chunk_gated_delta_rule(*inputs, cu_seqlens=torch.tensor([0, 20, 50])))


def test_cu_seqlens_with_batch_larger_than_one_is_refused():
    inputs = [x.detach() for x in make_inputs(2, 10)]
    with pytest.raises(ValueError, match="batch size must be 1"):
        gated_delta_rule(*inputs, cu_seqlens=torch.tensor([0, 5, 10]))
