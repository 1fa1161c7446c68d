"""FLA's CUDA kernels (behind gated_delta_rule) in bf16 against our torch references in fp32
fed the same bf16-rounded inputs.

Errors are relative in norm, ||fla - ref|| / ||ref||, over a whole tensor. bf16 outputs round by ~4e-3 relative
and FLA keeps some intermediates in bf16, so results land near 5e-3 (measured on H100 / H200); 2e-2 is bf16
level with margin, while a wrong reset, decay or gradient gives O(1). The per-head self-check that guards
FLA's Hopper bypass is tested in tests/unit/test_fla_check.py and measured by benchmarks/tools/fla_backward_errors.py.

Only bf16, at the head shapes of tests/gpu/test_model_cuda.py: FLA compiles its kernels once per shape, dtype
and layout (~80-100 s each on a fresh H100 / H200 when it autotunes them; a few seconds with the configs
conftest.py pins), which bounds what this suite can afford; the fp32 FLA path (training with
mixed_precision_param = float32) is not covered here."""

import pytest
import torch
import torch.nn.functional as F

from models.qwen35_moe.kernels.fla_hopper_guard import enable_fla_hopper_backward
from models.qwen35_moe.kernels.fla_varlen import fla_chunk_indices
from models.qwen35_moe.kernels.gated_delta_rule import gated_delta_rule, torch_chunk_gated_delta_rule

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="FLA kernels need a CUDA GPU")

HK, HV, DK, DV = 2, 4, 128, 128  # as test_model_cuda.ARGS: one set of compiled kernels for the suite
CU_SEQLENS = [0, 190, 701, 1000]  # three documents, none a multiple of FLA's 64-token chunk
REL_TOL = 2e-2


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


@pytest.mark.parametrize("layout", ["packed_documents", "batch_of_rows"])
def test_fla_gated_delta_rule_matches_torch_reference(layout):
    dtype = torch.bfloat16
    enable_fla_hopper_backward(HK, HV, DK, DV, "cuda")
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
    assert max(errors.values()) < REL_TOL, errors


@pytest.mark.parametrize("cu_seqlens", [CU_SEQLENS, [0, 1, 64, 65, 193, 256], [0, 4096]])
def test_our_chunk_index_is_flas(cu_seqlens):
    from fla.ops.utils.index import prepare_chunk_indices

    want = prepare_chunk_indices(torch.tensor(cu_seqlens, device="cuda"), 64)
    assert torch.equal(fla_chunk_indices(torch.tensor(cu_seqlens)), want.cpu())


def test_fla_kernels_with_our_host_chunk_index_are_bitwise_flas_own():
    """cu_seqlens_cpu given: FLA runs on the chunk index we upload without a host sync (the trainer's path)."""
    enable_fla_hopper_backward(HK, HV, DK, DV, "cuda")
    inputs = gdn_inputs(1, CU_SEQLENS[-1], torch.bfloat16)
    do = torch.randn(1, CU_SEQLENS[-1], HV, DV, device="cuda")
    host = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    ours = output_and_grads(gated_delta_rule, inputs, do, cu_seqlens=host.cuda(), cu_seqlens_cpu=host)
    flas = output_and_grads(gated_delta_rule, inputs, do, cu_seqlens=host.cuda())
    for a, b in zip(ours, flas, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["packed_documents", "batch_of_rows"])
def test_saved_states_function_is_bitwise_flas_own(layout):
    """fla_saved_states.py runs FLA's kernels in FLA's order but keeps w, h and v_new from the forward instead of
    recomputing them in the backward. Reference: FLA's public chunk_gated_delta_rule on the same (normalised,
    per-value-head) inputs. The recomputed tensors are the same deterministic kernels on the same inputs, so the
    output and every gradient must be bitwise FLA's."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from models.qwen35_moe.kernels.fla_saved_states import SavedStatesGatedDeltaRule
    from models.qwen35_moe.kernels.gated_delta_rule import _qk_per_value_head

    enable_fla_hopper_backward(HK, HV, DK, DV, "cuda")
    if layout == "packed_documents":
        B, T, cu_seqlens = 1, CU_SEQLENS[-1], torch.tensor(CU_SEQLENS, device="cuda")
    else:
        B, T, cu_seqlens = 2, 333, None
    q, k, v, g, beta = gdn_inputs(B, T, torch.bfloat16, seed=3)
    q, k = _qk_per_value_head(q, k, HV)
    do = torch.randn(B, T, HV, DV, device="cuda")

    def flas(q, k, v, g, beta):
        return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens)[0]

    def ours(q, k, v, g, beta):
        return SavedStatesGatedDeltaRule.apply(q, k, v, g, beta, DK ** -0.5, cu_seqlens, None)

    for a, b in zip(output_and_grads(ours, [q, k, v, g, beta], do), output_and_grads(flas, [q, k, v, g, beta], do),
                    strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
