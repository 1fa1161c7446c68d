"""FSDP2 with bf16 params (2 gloo ranks, forced on CPU): the fp32 contract holds inside forward, in gradients and
in optimizer state, and RoPE angles are never rounded to bf16, at positions near 32k and 256k."""

import pytest
import torch

from models.qwen35_moe import get_flavor
from tests.distributed.launch import Run, register

FP32_PARAMS = ("_fp32_params.A_log", "_fp32_params.dt_bias", "norm.weight")  # of each linear_attn
STEP = register(Run("fsdp_bf16/step", 2, "tests.distributed.fsdp_bf16_worker:step"))


@pytest.fixture(scope="module")
def record(launches):
    return torch.load(launches.folder_of(STEP) / "result.pt")


def gdn_layers():
    return [i for i, t in enumerate(get_flavor("debugmodel").layer_types) if t == "linear_attention"]


def test_ssm_gate_and_gdn_norm_are_fp32_in_forward_and_gradients_next_to_bf16_weights(record):
    for i in gdn_layers():
        for suffix in FP32_PARAMS:
            key = f"layers.{i}.linear_attn.{suffix}"
            assert record["forward"][key] == torch.float32, key
            assert record["grads"][key] == torch.float32, key
    assert record["forward"]["layers.0.linear_attn.in_proj_qkv.weight"] == torch.bfloat16
    assert record["grads"]["layers.0.linear_attn.in_proj_qkv.weight"] == torch.bfloat16


def test_optimizer_state_of_the_fp32_params_is_fp32(record):
    for suffix in FP32_PARAMS:
        state = record["optimizer"][f"layers.0.linear_attn.{suffix}"]
        assert state and all(dtype == torch.float32 for dtype in state.values()), (suffix, state)


def test_rope_is_the_fp32_rotation_rounded_once_at_32k_and_256k(record):
    """Under FSDP the blocks' floating inputs are cast to bf16, which once rounded cos/sin (a second rounding
    that left 7-8% of rotated q/k elements beyond bf16's half-ulp). Reference: transformers' rotary embedding in
    fp32 applied to the same pre-rotation q and k; every element of ours must be that value rounded once to bf16
    (|ours - ref| <= 2^-8 |ref|), and the attention logits as close to fp32 as bf16-rounded q and k allow."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        Qwen3_5MoeTextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    hf_config = Qwen3_5MoeTextConfig(**get_flavor("debugmodel").to_hf_config())
    rotary = Qwen3_5MoeTextRotaryEmbedding(hf_config)
    cos, sin = rotary(torch.zeros((), dtype=torch.float32), record["positions"])
    assert len(record["rope"]) == 2  # q then k of the one attention layer
    assert all(r["cos_dtype"] == r["sin_dtype"] == torch.float32 for r in record["rope"])
    q, k = record["rope"]
    q_ref, k_ref = apply_rotary_pos_emb(q["x"].float(), k["x"].float(), cos, sin, unsqueeze_dim=2)
    for got, ref, x in ((q["out"], q_ref, q["x"]), (k["out"], k_ref, k["x"])):
        assert got.dtype == torch.bfloat16
        slack = 1e-6 * x.float().abs().max()  # fp32 ulps between two fp32 formulas for cos/sin
        assert ((got.float() - ref).abs() <= 2**-8 * ref.abs() + slack).all()

    def logits_error(qq, kk):
        ref = torch.einsum("bshd,bthd->bhst", q_ref.double(), k_ref.repeat_interleave(2, dim=2).double())
        got = torch.einsum("bshd,bthd->bhst", qq.double(), kk.repeat_interleave(2, dim=2).double())
        return ((got - ref).abs().amax((1, 2, 3)) / ref.abs().amax((1, 2, 3)))  # per row: 32k, 256k

    bf16_level = logits_error(q_ref.bfloat16(), k_ref.bfloat16())
    assert (logits_error(q["out"], k["out"]) <= 1.05 * bf16_level).all()
