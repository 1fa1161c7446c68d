"""Qwen3.5-MoE causal language model: a hybrid stack of Gated DeltaNet and gated full attention layers,
each followed by a sparse MoE block.

Build it on the meta device, then materialise and initialise it explicitly (ready for FSDP):

    with torch.device("meta"):
        model = Qwen35MoeModel(args)
    model.to_empty(device="cpu")
    model.init_weights()
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .args import FULL_ATTENTION, Qwen35MoeArgs
from .attention import GatedAttention
from .documents import DocumentLayout, document_layout
from .gated_deltanet import CPAwareGatedDeltaNet
from .moe import SparseMoE
from .norms import ZeroCenteredRMSNorm
from .rope import rope_cos_sin


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # (B, S, vocab)
    aux_loss: torch.Tensor  # MoE load-balancing loss averaged over layers (unscaled by its coefficient)


class DecoderLayer(nn.Module):
    def __init__(self, args: Qwen35MoeArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = ZeroCenteredRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if layer_type == FULL_ATTENTION:
            self.self_attn = GatedAttention(args)
        else:
            self.linear_attn = CPAwareGatedDeltaNet(args)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = SparseMoE(args)

    def init_weights(self, std: float) -> None:
        self.input_layernorm.init_weights()
        self.post_attention_layernorm.init_weights()
        self.mixer.init_weights(std)
        self.mlp.init_weights(std)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn if self.layer_type == FULL_ATTENTION else self.linear_attn

    def forward(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layout: DocumentLayout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.input_layernorm(h)
        if self.layer_type == FULL_ATTENTION:
            h = h + self.self_attn(x, rope, layout)
        else:
            h = h + self.linear_attn(x, layout.cu_seqlens)
        moe_out, aux = self.mlp(self.post_attention_layernorm(h))
        return h + moe_out, aux


class Qwen35MoeModel(nn.Module):
    def __init__(self, args: Qwen35MoeArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        # A dict keyed by layer index keeps checkpoint keys stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(args, t) for i, t in enumerate(args.layer_types)})
        self.norm = ZeroCenteredRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """HF-like init: normal(0, initializer_range) matrices, zero-centred norms at 0, gated norm at 1,
        A_log = log U(0.01, 16), dt_bias = 1."""
        std = self.args.initializer_range
        nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=std)
        for layer in self.layers.values():
            layer.init_weights(std)
        self.norm.init_weights()
        if not self.args.tie_word_embeddings:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=std)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> CausalLMOutput:
        """input_ids (B, S); position_ids (B, S) restarting at 0 at each packed document (None: one
        document per row). Returns logits (B, S, vocab) and the MoE auxiliary loss."""
        batch, seq = input_ids.shape
        layout = document_layout(position_ids, batch, seq, input_ids.device)
        rope = rope_cos_sin(layout.position_ids, self.args.rotary_dim, self.args.rope_theta)

        h = self.embed_tokens(input_ids)
        aux_losses = []
        for layer in self.layers.values():
            h, aux = layer(h, rope, layout)
            aux_losses.append(aux)
        logits = self.lm_head(self.norm(h))
        aux_loss = torch.stack(aux_losses).mean() if aux_losses else logits.new_zeros((), dtype=torch.float32)
        return CausalLMOutput(logits=logits, aux_loss=aux_loss)
