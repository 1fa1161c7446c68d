"""The model's CUDA path (FLA kernels, grouped GEMM experts, varlen attention) against its CPU reference
path (pure-torch kernels), with the same weights.

bf16 cannot be compared to fp32 with a fixed tolerance: how far bf16 drifts depends on the model. So the
bf16 CUDA error is measured against the error of the CPU reference path itself run in bf16; a kernel bug
shows up as an error well beyond bf16's own (on Hopper the CUDA bf16 error sits at or below the CPU bf16 path's,
packed and unpacked). bf16 only: each FLA dtype costs FLA another compile (see test_fla_kernels.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from models.qwen35_moe import Qwen35MoeArgs, Qwen35MoeModel
from models.qwen35_moe.kernels.fla_hopper_guard import enable_fla_hopper_backward
from tests.builders import initialized_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Head dims of the real model (128 / 256) at small width, so FLA and grouped GEMM see real tile shapes.
ARGS = Qwen35MoeArgs(
    vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=128, rope_theta=10000.0, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=128, linear_value_head_dim=128, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=128, shared_expert_intermediate_size=128,
)
PACKED_POSITIONS = torch.cat((torch.arange(100), torch.arange(156))).expand(2, 256)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm()).item()


def build_reference_model() -> Qwen35MoeModel:
    """The fp32 CPU reference, with bf16-representable weights so every variant starts equal."""
    ref = initialized_model(ARGS)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if p.ndim == 1 and "_fp32_params" not in name:  # norms off their init so they matter
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                # A decisive router: near-uniform router probabilities would turn rounding into
                # top-k flips, measuring routing ties rather than kernels.
                p.normal_(0.0, 0.5)
    return ref.to(torch.bfloat16).float()


@pytest.fixture(scope="module")
def models():
    enable_fla_hopper_backward(ARGS.linear_num_key_heads, ARGS.linear_num_value_heads,
                               ARGS.linear_key_head_dim, ARGS.linear_value_head_dim, "cuda")
    ref = build_reference_model()
    return {
        "cpu_fp32": ref,
        "cpu_bf16": copy.deepcopy(ref).to(torch.bfloat16),
        "cuda_bf16": copy.deepcopy(ref).to("cuda", torch.bfloat16),
    }


def _batch(seed, batch=2, seq=256):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, ARGS.vocab_size, (batch, seq), generator=g)


def _logits(model, ids, positions=None):
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(ids.to(device), None if positions is None else positions.to(device)).logits


@pytest.mark.parametrize("positions", [None, PACKED_POSITIONS], ids=["one_document_per_row", "packed_rows"])
def test_cuda_bf16_logits_err_no_more_than_bf16_itself(models, positions):
    ids = _batch(2)
    ref = _logits(models["cpu_fp32"], ids, positions)
    bf16_level = _rel(_logits(models["cpu_bf16"], ids, positions), ref)
    assert _rel(_logits(models["cuda_bf16"], ids, positions), ref) < 1.5 * bf16_level


def _grads(model, ids, labels) -> torch.Tensor:
    model.zero_grad()
    device = next(model.parameters()).device
    logits = model(ids.to(device)).logits.float()
    F.cross_entropy(logits.flatten(0, 1), labels.to(device).flatten()).backward()
    return torch.cat([p.grad.float().cpu().flatten() for p in model.parameters()])


def test_cuda_bf16_grads_err_no_more_than_bf16_itself(models):
    ids, labels = _batch(3), _batch(4)
    ref = _grads(models["cpu_fp32"], ids, labels)
    bf16_level = _rel(_grads(models["cpu_bf16"], ids, labels), ref)
    assert _rel(_grads(models["cuda_bf16"], ids, labels), ref) < 2 * bf16_level


def test_ssm_gate_stays_fp32_on_cuda(models):
    layer = models["cuda_bf16"].layers["0"].linear_attn
    assert layer.A_log.dtype == torch.float32 and layer.A_log.is_cuda
    assert layer.in_proj_qkv.weight.dtype == torch.bfloat16


def test_packed_documents_on_cuda_match_separate_documents(models):
    gpu = models["cuda_bf16"]
    a, b = _batch(5, batch=1, seq=200).cuda(), _batch(6, batch=1, seq=157).cuda()
    positions = torch.cat((torch.arange(200), torch.arange(157))).unsqueeze(0).cuda()
    packed = _logits(gpu, torch.cat((a, b), dim=1), positions)
    separate = torch.cat((_logits(gpu, a), _logits(gpu, b)), dim=1)
    # Same kernels, different tiling of the varlen stream: bf16 rounding differences only (passed on H200).
    assert _rel(packed, separate) < 1e-2
