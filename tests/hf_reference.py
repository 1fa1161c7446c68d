"""Shared helpers for tests that compare against transformers' Qwen3_5MoeForCausalLM."""

from __future__ import annotations

import inspect

import torch

# A tiny hybrid config in config.json form: 3 Gated DeltaNet layers + 1 full attention layer, 8 experts top-2.
TINY_HF_CONFIG = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 96,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 24,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
}


def force_transformers_torch_kernels(monkeypatch) -> None:
    """With FLA installed (the `gpu` extra), transformers binds FLA's Triton kernels into its Qwen3.5 GDN
    layers, and they fail on CPU tensors; point its module-level kernel functions back at its own pure-torch
    versions. Without FLA (a CPU install, as in CI) transformers already runs those, and this changes nothing."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

    for name in (
        "torch_chunk_gated_delta_rule",
        "torch_recurrent_gated_delta_rule",
        "causal_conv1d_fn",
        "causal_conv1d_update",
    ):
        fn = getattr(modeling, name, None)
        if fn is not None:
            monkeypatch.setattr(modeling, name, inspect.unwrap(fn))


def build_hf_model(config_dict: dict, seed: int = 0):
    """transformers' model (fp32, eager attention) with every parameter moved away from its init so
    norms, router, gates and the SSM decay all matter."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig(**{k: v for k, v in config_dict.items() if k != "architectures"})
    config.architectures = config_dict["architectures"]
    config._attn_implementation = "eager"
    model = Qwen3_5MoeForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 4).log())  # decay rates of different heads
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif p.ndim == 1:  # norm weights
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.copy_(torch.randn_like(p) * 0.1)
    return model


def official_dtypes(hf: dict) -> dict:
    """An HF state dict in the official release's dtypes: bf16 except the fp32 GDN tensors."""
    from models.qwen35_moe.state_dict_adapter import hf_export_dtype

    return {k: v.to(hf_export_dtype(k, torch.bfloat16)) for k, v in hf.items()}


def per_expert(hf: dict) -> dict:
    """Split fused experts into the per-expert HF layout."""
    out = {}
    for k, v in hf.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            base = k.removesuffix(".gate_up_proj")
            for e, w in enumerate(v):
                gate, up = w.chunk(2, dim=0)
                out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"] = gate, up
        elif k.endswith("mlp.experts.down_proj"):
            base = k.removesuffix(".down_proj")
            for e, w in enumerate(v):
                out[f"{base}.{e}.down_proj.weight"] = w
        else:
            out[k] = v
    return out
