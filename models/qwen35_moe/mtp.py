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
across the boundary: their outputs are meaningless and their targets are ignored (`mtp_rows`). Attention still
never crosses documents (the main model's document layout is reused).

Training (the MTP loss, Megatron's definition): depth k's loss is the token mean of its cross entropy over its
valid targets, and the MTP loss the mean over the depths, weighted by `training.mtp_loss_coef` in the objective.
The shifted inputs and targets are built from the whole rows on the host (`mtp_rows`), before a context-parallel
rank takes its zigzag chunks of them: the shift to x_{t+1} then crosses chunk and rank boundaries with no exchange.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .args import Qwen35MoeArgs
from .documents import DocumentLayout
from .kernels.linear_cross_entropy import IGNORE_INDEX
from .linear import Linear
from .norms import ZeroCenteredRMSNorm


def next_token_ids(input_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) -> (B, S): x_{t+1} at t; the last position repeats x_{S-1} (no next token: its output is unused)."""
    return torch.cat((input_ids[:, 1:], input_ids[:, -1:]), dim=1)


def shifted_ids(input_ids: torch.Tensor, depth: int) -> torch.Tensor:
    """(B, S) -> (B, S, depth): at t, depth k's embedded token x_{t+k+1} (`next_token_ids` applied k + 1 times)."""
    ids, out = input_ids, []
    for _ in range(depth):
        ids = next_token_ids(ids)
        out.append(ids)
    return torch.stack(out, dim=-1)


def mtp_rows(input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor,
             depth: int) -> dict[str, torch.Tensor]:
    """The MTP's inputs and targets of whole (B, S) rows, as the trainer's batches hold them (labels[t] = x_{t+1}
    or IGNORE_INDEX: a token that opens another document, or, in chat rows, one that is not a target;
    position_ids restart at 0 at each document). Returns (B, S, depth) tensors:
    `mtp_input_ids` x_{t+k+1} (`shifted_ids`) and `mtp_labels` x_{t+k+2} = labels[t+k+1] where x_{t+1} ... x_{t+k+1}
    belong to x_t's document and t+k+1 lies in the row, else IGNORE_INDEX. The target's own document boundary and
    the chat target mask come with labels[t+k+1]."""
    batch, seq = input_ids.shape
    same_doc = torch.ones_like(labels, dtype=torch.bool)  # x_{t+1} ... x_{t+k+1} in x_t's document
    targets = []
    for k in range(depth):
        ahead = k + 1
        starts_ahead = torch.ones_like(same_doc)  # past the row: no input, no target
        starts_ahead[:, :seq - ahead] = position_ids[:, ahead:] == 0
        same_doc = same_doc & ~starts_ahead
        label = torch.full_like(labels, IGNORE_INDEX)
        label[:, :seq - ahead] = labels[:, ahead:]
        targets.append(torch.where(same_doc, label, IGNORE_INDEX))
    return {"mtp_input_ids": shifted_ids(input_ids, depth), "mtp_labels": torch.stack(targets, dim=-1)}


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
        """hidden (B, S, D): the main model's final-normed hidden states; input_ids (B, S, depth): at t, depth k's
        embedded token x_{t+k+1} (`shifted_ids`; under context parallelism this rank's chunks of the whole rows');
        `embed`: the main model's embedding lookup (in the compute dtype). Returns, per depth k, the normed output
        (B, S, D) for the lm_head (predicting x_{t+k+2}), and that depth's expert counts (E,) and router
        probability sums (E,)."""
        outputs, counts, prob_sums = [], [], []
        for k, layer in enumerate(self.layers.values()):
            joined = torch.cat((self.pre_fc_norm_embedding(embed(input_ids[..., k])),
                                self.pre_fc_norm_hidden(hidden)), dim=-1)
            h, layer_counts, layer_prob_sums = layer(self.fc(joined), layout)
            hidden = self.norm(h)
            outputs.append(hidden)
            counts.append(layer_counts)
            prob_sums.append(layer_prob_sums)
        return outputs, counts, prob_sums
