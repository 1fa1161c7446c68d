"""FLA's CUDA kernels (behind gated_delta_rule / causal_conv1d) against our torch references in fp32.

Errors are relative in norm, ||fla - ref|| / ||ref||, over a whole tensor. bf16 inputs carry ~4e-3
relative rounding each and the kernels accumulate in fp32, so bf16 results land near 5e-3 (measured on
H100); 2e-2 is bf16 level with margin, while a wrong reset, decay or gradient gives O(1)."""

import pytest
import torch
import torch.nn.functional as F

from models.qwen35_moe.causal_conv import causal_conv1d, torch_causal_conv1d
from models.qwen35_moe.gated_delta_rule import (
    enable_fla_hopper_backward,
    gated_delta_rule,
    torch_chunk_gated_delta_rule,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="FLA kernels need a CUDA GPU")

HK, HV, DK, DV = 4, 8, 128, 128
CU_SEQLENS = [0, 190, 701, 1000]  # three documents, none a multiple of FLA's 64-token chunk
# fp32 inputs: FLA's tl.dot may round operands to tf32 (10-bit mantissa, ~5e-4), so allow 5e-3.
REL_TOL = {torch.bfloat16: 2e-2, torch.float32: 5e-3}


def relative_error(actual, expected):
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def gdn_inputs(B, T, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen)
    q, k, v = randn(B, T, HK, DK), randn(B, T, HK, DK), randn(B, T, HV, DV)
    g = F.logsigmoid(randn(B, T, HV) + 2.0)  # fp32, as the model computes it
    beta = randn(B, T, HV).sigmoid()
    return [x.to("cuda", torch.float32 if x is g else dtype) for x in (q, k, v, g, beta)]


def output_and_grads(fn, inputs, do, **kwargs):
    inputs = [x.detach().requires_grad_() for x in inputs]
    o = fn(*inputs, **kwargs)
    return [o, *torch.autograd.grad(o, inputs, do.to(o.dtype))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["packed_documents", "batch_of_rows"])
def test_fla_gated_delta_rule_matches_torch_reference(dtype, layout):
    enable_fla_hopper_backward(HK, HV, DK, DV, "cuda", dtype=dtype)
    if layout == "packed_documents":
        B, T, cu_seqlens = 1, CU_SEQLENS[-1], torch.tensor(CU_SEQLENS, device="cuda")
    else:
        B, T, cu_seqlens = 2, 333, None
    inputs = gdn_inputs(B, T, dtype)
    do = torch.randn(B, T, HV, DV, device="cuda")
    actual = output_and_grads(gated_delta_rule, inputs, do, cu_seqlens=cu_seqlens)
    expected = output_and_grads(torch_chunk_gated_delta_rule, [x.float() for x in inputs], do, cu_seqlens=cu_seqlens)
    assert actual[0].dtype == dtype
    errors = {n: relative_error(a, e) for n, a, e in zip(["o", "dq", "dk", "dv", "dg", "dbeta"], actual, expected)}
    assert max(errors.values()) < REL_TOL[dtype], errors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fla_causal_conv_matches_torch_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    T, D, W = CU_SEQLENS[-1], 256, 4
    x = torch.randn(1, T, D, generator=gen).to("cuda", dtype)
    weight = (torch.randn(D, W, generator=gen) / W**0.5).to("cuda", dtype)
    do = torch.randn(1, T, D, device="cuda")
    cu_seqlens = torch.tensor(CU_SEQLENS, device="cuda")
    actual = output_and_grads(causal_conv1d, [x, weight], do, cu_seqlens=cu_seqlens)
    expected = output_and_grads(torch_causal_conv1d, [x.float(), weight.float()], do, cu_seqlens=cu_seqlens)
    assert actual[0].dtype == dtype
    errors = {n: relative_error(a, e) for n, a, e in zip(["y", "dx", "dweight"], actual, expected)}
    assert max(errors.values()) < REL_TOL[dtype], errors
