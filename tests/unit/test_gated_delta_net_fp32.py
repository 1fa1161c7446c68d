"""The fp32 checkpoint contract helpers."""

import torch

from models.qwen35_moe.fp32_contract import (
    FP32_GDN_PARAM_NAMES,
    GDN_FP32_CHECKPOINT_ARCHITECTURES,
    HOLDER_NAME,
    is_gated_delta_net_fp32_param_key,
    route_fp32_holder_key,
    strip_fp32_holder_key,
    upcast_gated_delta_net_fp32_state_tensor,
)


def test_constants():
    assert FP32_GDN_PARAM_NAMES == ("A_log", "dt_bias")
    assert HOLDER_NAME == "_fp32_params"
    assert "Qwen3_5MoeForCausalLM" in GDN_FP32_CHECKPOINT_ARCHITECTURES
    assert "Qwen3_5MoeForConditionalGeneration" in GDN_FP32_CHECKPOINT_ARCHITECTURES
    assert "Qwen3NextForCausalLM" in GDN_FP32_CHECKPOINT_ARCHITECTURES


def test_key_classification():
    assert is_gated_delta_net_fp32_param_key("model.layers.0.linear_attn.A_log")
    assert is_gated_delta_net_fp32_param_key("layers.0.linear_attn._fp32_params.dt_bias")
    assert not is_gated_delta_net_fp32_param_key("model.layers.0.linear_attn.norm.weight")
    assert not is_gated_delta_net_fp32_param_key("model.layers.3.self_attn.A_log")
    assert not is_gated_delta_net_fp32_param_key("model.layers.0.linear_attn.A_log_extra")


def test_route_and_strip_are_inverse_and_idempotent():
    bare = "model.language_model.layers.4.linear_attn.A_log"
    routed = "model.language_model.layers.4.linear_attn._fp32_params.A_log"
    assert route_fp32_holder_key(bare) == routed
    assert route_fp32_holder_key(routed) == routed  # already routed: no-op
    assert strip_fp32_holder_key(routed) == bare
    assert strip_fp32_holder_key(bare) == bare
    for untouched in ("model.layers.0.linear_attn.in_proj_a.weight", "model.layers.3.self_attn.dt_bias", "lm_head.weight"):
        assert route_fp32_holder_key(untouched) == untouched
        assert strip_fp32_holder_key(untouched) == untouched


def test_upcast_only_low_precision_gate_tensors():
    bf = torch.tensor([0.1, 0.2], dtype=torch.bfloat16)
    out = upcast_gated_delta_net_fp32_state_tensor("layers.0.linear_attn.A_log", bf)
    assert out.dtype == torch.float32 and torch.equal(out, bf.float())
    other = upcast_gated_delta_net_fp32_state_tensor("layers.0.linear_attn.out_proj.weight", bf)
    assert other.dtype == torch.bfloat16
    f64 = torch.tensor([0.1], dtype=torch.float64)
    assert upcast_gated_delta_net_fp32_state_tensor("layers.0.linear_attn.A_log", f64).dtype == torch.float64
