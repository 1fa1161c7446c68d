"""The model's CUDA path (FLA kernels, grouped GEMM experts, varlen attention) against its CPU fp32
reference path (pure-torch kernels), with the same weights."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from models.qwen35_moe import Qwen35MoeArgs, Qwen35MoeModel
from models.qwen35_moe.gated_delta_rule import enable_fla_hopper_backward

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Head dims of the real model (128 / 256) at small width, so FLA and grouped GEMM see real tile shapes.
ARGS = Qwen35MoeArgs(
    vocab_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=128, rope_theta=10000.0, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=128, linear_value_head_dim=128, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=128, shared_expert_intermediate_size=128,
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm()).item()


@pytest.fixture(scope="module")
def models():
    enable_fla_hopper_backward(ARGS.linear_num_key_heads, ARGS.linear_num_value_heads,
                               ARGS.linear_key_head_dim, ARGS.linear_value_head_dim, "cuda")
    torch.manual_seed(0)
    with torch.device("meta"):
        ref = Qwen35MoeModel(ARGS)
    ref.to_empty(device="cpu")
    ref.init_weights()
    with torch.no_grad():  # move norms and the router off their init so every path matters
        for name, p in ref.named_parameters():
            if p.ndim == 1 and "_fp32_params" not in name:
                p.add_(torch.randn_like(p) * 0.1)
    return ref, copy.deepcopy(ref).to("cuda", torch.bfloat16)


def _batch(seed, batch=2, seq=300):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, ARGS.vocab_size, (batch, seq), generator=g)


def test_bf16_cuda_logits_and_grads_match_fp32_cpu_reference(models):
    ref, gpu = models
    ids, labels = _batch(1), _batch(2)
    ref.zero_grad()
    gpu.zero_grad()
    out_ref = ref(ids).logits
    out_gpu = gpu(ids.cuda()).logits
    # bf16 activations and weights: ~0.4% per rounding, accumulated over 4 layers.
    assert _rel(out_gpu, out_ref) < 3e-2
    F.cross_entropy(out_ref.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(out_gpu.float().flatten(0, 1), labels.cuda().flatten()).backward()
    gpu_grads = dict(gpu.named_parameters())
    for name, p in ref.named_parameters():
        err = _rel(gpu_grads[name].grad, p.grad)
        assert err < 8e-2, f"{name}: relative grad error {err:.3e}"


def test_ssm_gate_stays_fp32_on_cuda(models):
    _, gpu = models
    layer = gpu.layers["0"].linear_attn
    assert layer.A_log.dtype == torch.float32 and layer.A_log.is_cuda
    assert layer.in_proj_qkv.weight.dtype == torch.bfloat16


def test_packed_documents_on_cuda_match_separate_documents(models):
    _, gpu = models
    a, b = _batch(3, batch=1, seq=200).cuda(), _batch(4, batch=1, seq=157).cuda()
    positions = torch.cat((torch.arange(200), torch.arange(157))).unsqueeze(0).cuda()
    with torch.no_grad():
        packed = gpu(torch.cat((a, b), dim=1), positions).logits
        separate = torch.cat((gpu(a).logits, gpu(b).logits), dim=1)
    # Same kernels, different tiling of the varlen stream: bf16 rounding differences only.
    assert _rel(packed, separate) < 1e-2


def test_packed_rows_on_cuda_match_cpu_reference(models):
    ref, gpu = models
    ids = _batch(5, batch=2, seq=256)
    positions = torch.cat((torch.arange(100), torch.arange(156))).expand(2, 256)
    with torch.no_grad():
        assert _rel(gpu(ids.cuda(), positions.cuda()).logits, ref(ids, positions).logits) < 3e-2
