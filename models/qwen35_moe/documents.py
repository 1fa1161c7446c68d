"""Document boundaries inside packed rows.

The data pipeline packs several documents into each row of `seq_len` tokens and passes
`position_ids` that restart at 0 at every document start. From them the model derives, once per
forward, what each mixer needs so that nothing crosses a document boundary:
- Gated DeltaNet and its causal conv: `cu_seqlens` over the flattened (B * S) token stream (FLA's varlen
  convention), so the recurrent state and conv history reset at each document.
- Full attention: `document_ids` (a block-diagonal causal mask) or `cu_seqlens` for varlen kernels.
Deriving it takes host syncs on a GPU (whether rows are packed, the document count, the longest document), so
the trainer derives it on the host from the batch's CPU position ids and hands it to the model (`layout.to`
copies it to the GPU without waiting); the model derives it itself only when given position ids alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class DocumentLayout:
    position_ids: torch.Tensor  # (B, S), restarting at 0 at each document
    # None when every row holds a single document: kernels then take the plain batched path.
    cu_seqlens: torch.Tensor | None = None  # (N + 1,) int32, over the flattened B * S tokens
    max_seqlen: int = 0  # longest document, for varlen attention kernels
    document_ids: torch.Tensor | None = None  # (B, S) index of the document within its row
    # Under context parallelism the rows are split over ranks: position_ids above are this rank's tokens',
    # `global_layout` is the layout of the whole rows and `token_index` (S_local,) where this rank's tokens sit.
    global_layout: DocumentLayout | None = None
    token_index: torch.Tensor | None = None
    # Varlen attention segments of this rank's queries (context_parallel_segments), built by the first attention
    # layer that needs them and shared by the others.
    cp_segments: ContextParallelSegments | None = None
    cu_seqlens_cpu: torch.Tensor | None = None  # a host copy of cu_seqlens, when it was derived on the host

    def __post_init__(self):
        _mark_varying(self.cu_seqlens)

    @property
    def is_packed(self) -> bool:
        return self.cu_seqlens is not None

    def to(self, device: torch.device) -> DocumentLayout:
        """This layout with its tensors on `device` (copies from pinned host memory do not wait for the GPU);
        the host copy of cu_seqlens stays on the host for the kernels that need their sizes there."""
        if self.position_ids.device == torch.device(device):
            return self
        return replace(self, position_ids=to_device(self.position_ids, device),
                       cu_seqlens=to_device(self.cu_seqlens, device), document_ids=to_device(self.document_ids, device),
                       token_index=to_device(self.token_index, device),
                       global_layout=self.global_layout.to(device) if self.global_layout is not None else None,
                       cp_segments=self.cp_segments.to(device) if self.cp_segments is not None else None)


def _mark_varying(*tensors: torch.Tensor | None) -> None:
    """Marks tensors whose first size changes with where documents fall (a layout's, every time one is made, on
    the host or by `to`) so for torch.compile: compiled blocks take that size as a symbol from their first compile,
    instead of compiling for the first batch's document count and again, with it symbolic, at the first batch with
    another (a recompile of every block that reads it)."""
    for t in tensors:
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, 0)


def to_device(t: torch.Tensor | None, device) -> torch.Tensor | None:
    """A (host) tensor on `device`; to a GPU through pinned memory, so the copy does not make the host wait."""
    if t is None or t.device == torch.device(device):
        return t
    if torch.device(device).type == "cuda":
        t = t.contiguous().pin_memory()  # an expanded view (rows sharing their positions) cannot be pinned
    return t.to(device, non_blocking=True)


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Where documents start in rows of position ids (last dimension: the row): at position 0, and at every row's
    first token, even where a row continues a document from the row before."""
    first = torch.arange(position_ids.shape[-1], device=position_ids.device) == 0
    return (position_ids == 0) | first


def document_layout(position_ids: torch.Tensor | None, batch: int, seq_len: int, device: torch.device,
                    packed: bool = False) -> DocumentLayout:
    """Derive the document layout of a (B, S) batch from its position ids (None: one document per row).

    Rows that hold one document each get the plain (unpacked) layout, unless `packed`: then every batch with
    position ids gets the varlen one, cu_seqlens at the rows' starts where each row is one document. Training asks
    for that (Trainer.model_inputs), so its kernels and compiled graphs never depend on where the documents fall:
    the first batch of whole-row documents (common with long documents) would take the other path mid-run,
    recompiling the blocks and making FLA compile, and autotune, its non-varlen kernels (docs/performance.md,
    "Tried, not kept")."""
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=device).expand(batch, seq_len)
        return DocumentLayout(position_ids=position_ids, max_seqlen=seq_len)
    if position_ids.shape != (batch, seq_len):
        raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, expected {(batch, seq_len)}")
    starts = document_starts(position_ids)
    # One host sync per forward (none for host position ids): kernels need to know whether rows are packed at all.
    if not packed and int(starts.sum()) == batch:
        return DocumentLayout(position_ids=position_ids, max_seqlen=seq_len)
    flat_starts = starts.reshape(-1).nonzero().squeeze(-1)
    total = torch.tensor([batch * seq_len], device=device)
    cu_seqlens = torch.cat((flat_starts, total)).to(torch.int32)
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    document_ids = starts.cumsum(dim=1)
    return DocumentLayout(position_ids, cu_seqlens, max_seqlen, document_ids,
                          cu_seqlens_cpu=cu_seqlens if cu_seqlens.device.type == "cpu" else None)


def context_parallel_layout(position_ids: torch.Tensor, global_position_ids: torch.Tensor,
                            token_index: torch.Tensor, packed: bool = False) -> DocumentLayout:
    """The layout of this rank's share of the rows (position_ids, B x S_local) under context parallelism, given
    the whole rows' position ids (B x S) and where the local tokens sit in a row; `packed` as document_layout's."""
    batch, seq = global_position_ids.shape
    whole = document_layout(global_position_ids, batch, seq, global_position_ids.device, packed)
    return DocumentLayout(position_ids=position_ids, global_layout=whole, token_index=token_index)


@dataclass
class ContextParallelSegments:
    """This rank's queries under context parallelism cut into varlen segments for a flash kernel.

    A segment is the run of local tokens of one document inside one zigzag chunk; its keys are that document's
    tokens from its start up to the segment's last query (positions in the whole rows). With the segment's queries
    the last of its keys, a causal mask aligned to the bottom right (flash attention's for unequal lengths) is
    exactly "causal within the document"."""
    cu_seqlens_q: torch.Tensor  # (N + 1,) int32, over the flattened B * S_local local tokens
    cu_seqlens_k: torch.Tensor  # (N + 1,) int32, over the gathered keys below
    key_index: torch.Tensor  # (total_k,) indices into the flattened B * S whole-row keys, segment after segment
    max_seqlen_q: int
    max_seqlen_k: int

    def __post_init__(self):
        _mark_varying(self.cu_seqlens_q, self.cu_seqlens_k, self.key_index)

    def to(self, device: torch.device) -> ContextParallelSegments:
        return replace(self, cu_seqlens_q=to_device(self.cu_seqlens_q, device),
                       cu_seqlens_k=to_device(self.cu_seqlens_k, device), key_index=to_device(self.key_index, device))


def context_parallel_segments(layout: DocumentLayout) -> ContextParallelSegments:
    """Build the varlen segments of a context-parallel layout (one host sync for the sizes)."""
    whole, index = layout.global_layout, layout.token_index
    batch, seq = whole.position_ids.shape
    local = index.numel()
    device = index.device
    positions = torch.arange(seq, device=device)
    starts = document_starts(whole.position_ids)
    doc_start = torch.cummax(torch.where(starts, positions, 0), dim=1).values  # (B, S) row position of its doc's start
    # A segment starts at each row's first local token, where the local tokens jump (a chunk edge), and at each
    # document start.
    jump = torch.ones(local, dtype=torch.bool, device=device)
    jump[1:] = index[1:] != index[:-1] + 1
    seg_start = (jump.unsqueeze(0) | starts[:, index]).reshape(-1).nonzero().squeeze(-1)  # over B * S_local
    total_q = torch.tensor([batch * local], device=device)
    cu_q = torch.cat((seg_start, total_q))
    len_q = cu_q[1:] - cu_q[:-1]
    row, first = seg_start // local, seg_start % local
    key_start = doc_start[row, index[first]]  # row position of the segment's document start
    key_end = index[first + len_q - 1] + 1  # one past the segment's last query
    len_k = key_end - key_start
    cu_k = torch.cat((len_k.new_zeros(1), len_k.cumsum(0)))
    total_k, max_q, max_k = torch.stack((cu_k[-1], len_q.max(), len_k.max())).tolist()
    key_index = torch.repeat_interleave(row * seq + key_start - cu_k[:-1], len_k, output_size=total_k)
    key_index = key_index + torch.arange(total_k, device=device)
    return ContextParallelSegments(cu_q.to(torch.int32), cu_k.to(torch.int32), key_index, max_q, max_k)
