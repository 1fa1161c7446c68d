"""Named model shapes. The released ones follow the official config.json files."""

from __future__ import annotations

import copy
import dataclasses

from .args import Qwen35MoeArgs

qwen35_moe_flavors: dict[str, Qwen35MoeArgs] = {
    # Tiny hybrid model for CPU tests and the embedded default: a GDN layer then a full attention layer, 8 experts
    # top-2. Vocab 512 covers the byte tokenizer (256 bytes + specials). Two layers, not the release's 3 + 1: a CPU
    # step costs about its layer count, and the test suite runs hundreds of them (tests that need several blocks of
    # one kind use tests/data/debugmodel_4_layers.json).
    "debugmodel": Qwen35MoeArgs(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        full_attention_interval=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.5,
        rope_theta=10000.0,
        mrope_section=[2, 1, 1],
        max_position_embeddings=4096,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        eos_token_id=None,
    ),
    # The released models: the official config.json's values, each with one multi-token-prediction layer
    # (`mtp_num_hidden_layers: 1`), trained with weight training.mtp_loss_coef (mtp.py).
    "35B-A3B": Qwen35MoeArgs(mtp_num_hidden_layers=1),
    "122B-A10B": Qwen35MoeArgs(
        hidden_size=3072,
        num_hidden_layers=48,
        num_attention_heads=32,
        linear_num_value_heads=64,
        moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024,
        mtp_num_hidden_layers=1,
    ),
    "397B-A17B": Qwen35MoeArgs(
        hidden_size=4096,
        num_hidden_layers=60,
        num_attention_heads=32,
        linear_num_value_heads=64,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024,
        mtp_num_hidden_layers=1,
    ),
}
# The debug model with one MTP layer: CPU tests and examples of MTP training
qwen35_moe_flavors["debugmodel_mtp"] = dataclasses.replace(qwen35_moe_flavors["debugmodel"], mtp_num_hidden_layers=1)


def get_flavor(name: str) -> Qwen35MoeArgs:
    if name not in qwen35_moe_flavors:
        raise ValueError(f"unknown qwen35_moe flavor {name!r}; known: {', '.join(qwen35_moe_flavors)}")
    # A copy, so callers may adjust fields without touching the registry.
    return copy.deepcopy(qwen35_moe_flavors[name])
