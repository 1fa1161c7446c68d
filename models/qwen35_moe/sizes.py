"""Parameter counts of a model from its args alone: plain arithmetic, no torch, no module built.

What the memory check before a run reads (harness/memory_check.py): a config of absurd sizes (a billion-wide hidden
state, a million layers) must be refused in a fraction of a second, before building even its meta model would
hang. The counts equal the built model's (tests/unit/test_sizes.py holds them to `Qwen35MoeModel` and to LoRA's
`add_adapters` for every flavor).
"""

from __future__ import annotations

from dataclasses import dataclass

from .args import FULL_ATTENTION, LINEAR_ATTENTION, Qwen35MoeArgs
from .lora_targets import LoraArgs


@dataclass(frozen=True)
class ParameterCounts:
    total: int  # every parameter (a tied lm_head counted once)
    experts: int  # of them, in the routed experts (the MTP layers' included)
    mtp: int  # of them, in the MTP layers


def _attention(args: Qwen35MoeArgs) -> int:
    h, heads, kv, d = args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim
    weights = h * 2 * heads * d + 2 * h * kv * d + heads * d * h  # q (query and gate), k, v, o
    biases = (2 * heads * d + 2 * kv * d + h) if args.attention_bias else 0
    return weights + biases + 2 * d  # q_norm, k_norm


def _gated_deltanet(args: Qwen35MoeArgs) -> int:
    h, nv = args.hidden_size, args.linear_num_value_heads
    key = args.linear_num_key_heads * args.linear_key_head_dim
    value = nv * args.linear_value_head_dim
    qkv = 2 * key + value
    # in_proj_qkv, in_proj_z, in_proj_b and in_proj_a, the depthwise conv, A_log and dt_bias, the output norm, out_proj
    return h * qkv + h * value + 2 * h * nv + qkv * args.linear_conv_kernel_dim + 2 * nv \
        + args.linear_value_head_dim + value * h


def _routed_experts(args: Qwen35MoeArgs) -> int:
    return args.num_experts * 3 * args.moe_intermediate_size * args.hidden_size  # gate_up (2I, H) and down (H, I)


def _moe(args: Qwen35MoeArgs) -> int:
    h = args.hidden_size
    # router, routed experts, shared expert (gate, up, down), its gate
    return args.num_experts * h + _routed_experts(args) + 3 * h * args.shared_expert_intermediate_size + h


def _layer(args: Qwen35MoeArgs, layer_type: str) -> int:
    mixer = _attention(args) if layer_type == FULL_ATTENTION else _gated_deltanet(args)
    return mixer + _moe(args) + 2 * args.hidden_size  # the two layer norms


def parameter_counts(args: Qwen35MoeArgs) -> ParameterCounts:
    """The parameters of `Qwen35MoeModel(args)`."""
    h, v = args.hidden_size, args.vocab_size
    layers = sum(args.num_layers_of(t) * _layer(args, t) for t in (FULL_ATTENTION, LINEAR_ATTENTION))
    head = 0 if args.tie_word_embeddings else v * h
    mtp = args.mtp_num_hidden_layers * _layer(args, FULL_ATTENTION)
    if args.mtp_num_hidden_layers:
        mtp += 2 * h + 2 * h * h + h  # the two pre-fc norms, fc (2H -> H), the final norm
    total = v * h + layers + h + head + mtp
    experts = (args.num_hidden_layers + args.mtp_num_hidden_layers) * _routed_experts(args)
    return ParameterCounts(total, experts, mtp)


def adapter_count(args: Qwen35MoeArgs, lora: LoraArgs) -> int:
    """LoRA's adapter parameters (models/qwen35_moe/lora.py): each adapted (out, in) projection rank * (in + out),
    each routed expert's gate_up and down pairs; the MTP layers' with `lora.mtp`."""
    rank, targets, mtp = lora.rank, lora.targets, lora.mtp
    h = args.hidden_size
    heads, kv, d = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    key = args.linear_num_key_heads * args.linear_key_head_dim
    value = args.linear_num_value_heads * args.linear_value_head_dim
    i, shared, e = args.moe_intermediate_size, args.shared_expert_intermediate_size, args.num_experts
    shapes = {  # target: [(in, out), ...] of one layer
        "q_proj": [(h, 2 * heads * d)], "k_proj": [(h, kv * d)], "v_proj": [(h, kv * d)], "o_proj": [(heads * d, h)],
        "in_proj_qkv": [(h, 2 * key + value)], "in_proj_z": [(h, value)],
        "in_proj_a": [(h, args.linear_num_value_heads)], "in_proj_b": [(h, args.linear_num_value_heads)],
        "out_proj": [(value, h)], "shared_expert": [(h, shared), (h, shared), (shared, h)],
        "shared_expert_gate": [(h, 1)], "router": [(h, e)],
    }
    mixers = {FULL_ATTENTION: ("q_proj", "k_proj", "v_proj", "o_proj"),
              LINEAR_ATTENTION: ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")}

    def layer(layer_type: str) -> int:
        chosen = [t for t in targets if t in mixers[layer_type] or t in ("shared_expert", "shared_expert_gate",
                                                                          "router")]
        total = sum(rank * (fan_in + fan_out) for t in chosen for fan_in, fan_out in shapes[t])
        if "experts" in targets:
            # gate_up: A (r, H), B (2I, r); down: A (r, I), B (H, r), r the experts' own rank
            total += e * lora.experts_rank * ((h + 2 * i) + (i + h))
        return total

    total = sum(args.num_layers_of(t) * layer(t) for t in (FULL_ATTENTION, LINEAR_ATTENTION))
    if mtp and args.mtp_num_hidden_layers:
        total += args.mtp_num_hidden_layers * layer(FULL_ATTENTION)
        total += rank * (2 * h + h) if "fc" in targets else 0
    return total
