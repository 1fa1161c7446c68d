"""Training FLOPs per token of the model, from its args alone: what MFU counts (harness/metrics.py).

Convention (PaLM / torchtitan, so figures compare across harnesses): 6 FLOPs per active matmul parameter per token
(forward + backward), plus the token mixers' own matmuls: full attention counted over the whole context
(12 * heads * head_dim * seq_len per layer, no causal halving) and the chunked gated delta rule's per-token matmuls
(3x forward). Active parameters are what one token touches: attention / GDN projections, router, top-k routed
experts, shared expert, lm_head (not the embedding lookup).
"""

from __future__ import annotations

from .args import FULL_ATTENTION, LINEAR_ATTENTION, Qwen35MoeArgs

GDN_CHUNK_SIZE = 64  # the chunked gated delta rule's chunk (FLA's and the torch reference's)


def active_matmul_params(args: Qwen35MoeArgs) -> int:
    """Matmul parameters one token touches (routed experts: top-k of them), in the main model."""
    attn, gdn, moe = _block_matmul_params(args)
    total = args.num_layers_of(FULL_ATTENTION) * attn + args.num_layers_of(LINEAR_ATTENTION) * gdn
    return total + args.num_hidden_layers * moe + args.hidden_size * args.vocab_size


def _block_matmul_params(args: Qwen35MoeArgs) -> tuple[int, int, int]:
    """Per token: the matmul parameters of a gated attention, a Gated DeltaNet and a MoE block (top-k experts)."""
    h = args.hidden_size
    attn = h * args.num_attention_heads * args.head_dim * 2 + 2 * h * args.num_key_value_heads * args.head_dim
    attn += args.num_attention_heads * args.head_dim * h
    key_dim = args.linear_num_key_heads * args.linear_key_head_dim
    value_dim = args.linear_num_value_heads * args.linear_value_head_dim
    gdn = h * (2 * key_dim + value_dim) + h * value_dim + 2 * h * args.linear_num_value_heads + value_dim * h
    gdn += (2 * key_dim + value_dim) * args.linear_conv_kernel_dim
    moe = h * args.num_experts + args.num_experts_per_tok * 3 * h * args.moe_intermediate_size
    moe += 3 * h * args.shared_expert_intermediate_size + h
    return attn, gdn, moe


def training_flops_per_token(args: Qwen35MoeArgs, attended: float, mtp: bool = False,
                             adapter_params: int | None = None) -> float:
    """Training FLOPs (forward + backward) per token. `attended`: the mean number of keys a query attends to,
    causal and within its document (`mean_attended_keys`): attention is counted by the rows' real documents,
    not as if every query saw the whole row. `mtp`: the MTP layers are trained too (each: its fc, a full-attention
    MoE block and the shared lm_head once more). `adapter_params`: a LoRA run's adapter parameters one token
    touches (models/qwen35_moe/lora.py `active_adapter_params`): the frozen weights then cost their forward and
    the backward to their inputs, 4 FLOPs a parameter, not 6 (no weight gradient), the adapters all 6."""
    per_param = 6 if adapter_params is None else 4
    attention = 12 * args.num_attention_heads * args.head_dim * attended
    dk, dv, c = args.linear_key_head_dim, args.linear_value_head_dim, GDN_CHUNK_SIZE
    # Chunked GDN forward per token and value head: 2 * (C * (3 Dk + 2 Dv) + 3 Dk Dv); x3 for training.
    gdn = 3 * 2 * args.linear_num_value_heads * (c * (3 * dk + 2 * dv) + 3 * dk * dv)
    mixers = args.num_layers_of(FULL_ATTENTION) * attention + args.num_layers_of(LINEAR_ATTENTION) * gdn
    total = per_param * active_matmul_params(args) + mixers + 6 * (adapter_params or 0)
    if mtp:
        h = args.hidden_size
        attn, _, moe = _block_matmul_params(args)
        total += args.mtp_num_hidden_layers * (per_param * (2 * h * h + attn + moe + h * args.vocab_size) + attention)
    return total
