"""Document boundaries inside packed rows.

The data pipeline packs several documents into each row of `seq_len` tokens and passes
`position_ids` that restart at 0 at every document start. From them the model derives, once per
forward, what each mixer needs so that nothing crosses a document boundary:
- Gated DeltaNet and its causal conv: `cu_seqlens` over the flattened (B * S) token stream (FLA's varlen
  convention), so the recurrent state and conv history reset at each document.
- Full attention: `document_ids` (a block-diagonal causal mask) or `cu_seqlens` for varlen kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DocumentLayout:
    position_ids: torch.Tensor  # (B, S), restarting at 0 at each document
    # None when every row holds a single document: kernels then take the plain batched path.
    cu_seqlens: torch.Tensor | None = None  # (N + 1,) int32, over the flattened B * S tokens
    max_seqlen: int = 0  # longest document, for varlen attention kernels
    document_ids: torch.Tensor | None = None  # (B, S) index of the document within its row

    @property
    def is_packed(self) -> bool:
        return self.cu_seqlens is not None


def document_layout(position_ids: torch.Tensor | None, batch: int, seq_len: int, device: torch.device) -> DocumentLayout:
    """Derive the document layout of a (B, S) batch from its position ids (None: one document per row)."""
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=device).expand(batch, seq_len)
        return DocumentLayout(position_ids=position_ids, max_seqlen=seq_len)
    if position_ids.shape != (batch, seq_len):
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, expected {(batch, seq_len)}")
    starts = position_ids == 0
    starts[:, 0] = True  # a row always starts a document, even mid-document continuation rows
    # One host sync per forward: kernels need to know whether rows are packed at all.
    if int(starts.sum()) == batch:
        return DocumentLayout(position_ids=position_ids, max_seqlen=seq_len)
    flat_starts = starts.reshape(-1).nonzero().squeeze(-1)
    total = torch.tensor([batch * seq_len], device=device)
    cu_seqlens = torch.cat((flat_starts, total)).to(torch.int32)
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    document_ids = starts.cumsum(dim=1)
    return DocumentLayout(position_ids, cu_seqlens, max_seqlen, document_ids)
