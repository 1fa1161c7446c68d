"""Multi-token prediction (MTP): the extra layer of the released Qwen3.5-MoE checkpoints (`mtp.*`) that predicts
the token after next.

The definition, as the serving engine that runs these checkpoints computes it (vLLM,
`vllm/model_executor/models/qwen3_5_mtp.py`, `Qwen3_5MultiTokenPredictor.forward`, with the drafter feeding it
the main model's output hidden states and ids shifted by one), for position t of a row x:

    h_t       the main model's last hidden state AFTER its final norm (`model.norm`): the tensor the lm_head
              reads. vLLM's main model returns `self.norm(hidden, residual)` and its `compute_logits` applies the
              lm_head to that same tensor; the drafter passes it on as the MTP's `hidden_states`.
    e_t       embed_tokens(x_{t+1}), the main model's (shared) embedding (`mtp_use_dedicated_embeddings`: false)
    u_t       fc(cat(pre_fc_norm_embedding(e_t), pre_fc_norm_hidden(h_t)))   -- embedding FIRST, then hidden;
              fc: Linear(2D -> D, no bias)
    v         layers.0(u): a full-attention decoder layer (gated attention + sparse MoE with shared expert, the
              main full-attention layers' structure and weight names), at the positions of h_t (the drafter
              passes the main model's positions unchanged), causal within each document
    out_t     norm(v_t), fed to the shared lm_head: logits for x_{t+2}

All three norms are the zero-centred `(1 + w)` RMSNorm of the main model (vLLM builds them as `Qwen3_5RMSNorm`,
its GemmaRMSNorm). With `mtp_num_hidden_layers` = n > 1, depth k uses layer k on the previous depth's output and
x_{t+k+1}, the fc and the norms shared, as vLLM's `spec_step_idx % num_mtp_layers` does; the releases have n = 1.

Positions t whose x_{t+1} lies in the next document or past the row (each document's last token) get an input
across the boundary: their outputs are meaningless and their targets must be ignored. Attention still never
crosses documents (the main model's document layout is reused). Under context parallelism each rank holds zigzag
chunks, so x_{t+1} is not the next local token: refused until the shift goes through the CP exchange.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .args import Qwen35MoeArgs
from .documents import DocumentLayout
from .linear import Linear
from .norms import ZeroCenteredRMSNorm


def next_token_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) -> (B, S): x_{t+1} at t; the last position repeats x_{S-1} (no next token: its output is unused)."""
    return torch.cat((input_ids[:, 1:], input_ids[:, -1:]), dim=1)


class MultiTokenPredictor(nn.Module):
    """The `mtp.*` module: shared-embedding MTP with `len(layers)` chained depths (definition in the docstring)."""

    def __init__(self, args: Qwen35MoeArgs, layers: list[nn.Module]):
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(dim, eps=eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(dim, eps=eps)
        self.fc = Linear(2 * dim, dim, bias=False)
        # Full-attention DecoderLayers, passed in (model.py defines them); keyed like the main stack's layers.
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(layers)})
        self.norm = ZeroCenteredRMSNorm(dim, eps=eps)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor],
                layout: DocumentLayout) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """hidden (B, S, D): the main model's final-normed hidden states; input_ids (B, S); `embed`: the main model's
        embedding lookup (in the compute dtype). Returns, per depth k, the normed output (B, S, D) for the lm_head
        (predicting x_{t+k+2}), and that depth's expert counts (E,) and router probability sums (E,)."""
        outputs, counts, prob_sums = [], [], []
        ids = input_ids
        for layer in self.layers.values():
            ids = next_token_ids(ids)
            joined = torch.cat((self.pre_fc_norm_embedding(embed(ids)), self.pre_fc_norm_hidden(hidden)), dim=-1)
            h, layer_counts, layer_prob_sums = layer(self.fc(joined), layout)
            hidden = self.norm(h)
            outputs.append(hidden)
            counts.append(layer_counts)
            prob_sums.append(layer_prob_sums)
        return outputs, counts, prob_sums
