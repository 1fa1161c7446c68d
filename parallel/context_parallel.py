"""Context parallelism: the zigzag sequence layout and the exchanges the CP-aware layers run.

Layout (docs/design.md, "Parallelism"): each row of seq_len tokens is cut into 2 * cp chunks; CP rank r holds
chunks r and 2*cp-1-r, so every rank gets an equal share of causal attention work (early and late tokens).
The trainer shards a batch's rows this way (`CPContext.shard_rows`) and derives this rank's document layout on
the host from the whole rows every CP rank reads (`CPContext.rows_layout`, the one place the layout is built); a
model given only its share of the position ids all-gathers them once per forward (`CPContext.local_layout`).

Exchanges, differentiable (parallel/collectives.py, so backward runs the mirror collective):
  gather_sequence   local zigzag tokens -> the whole rows in natural order       (all-gather; backward: reduce-scatter)
  scatter_sequence  whole rows of partial sums -> this rank's tokens, summed     (reduce-scatter; backward: all-gather)
Gated DeltaNet runs head-parallel between the two (each rank: whole rows, 1/cp of the heads); attention gathers
K and V and keeps its local queries. The parallelize function sets a CPContext as the model's and its mixers'
`context_parallel` (models/qwen35_moe/hooks.py).
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.device_mesh import DeviceMesh

from models.qwen35_moe.documents import DocumentLayout, context_parallel_layout, context_parallel_segments

from .collectives import all_gather, reduce_scatter_sum


def zigzag_index(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """(seq_len / cp,) positions in the row of CP rank `rank`'s tokens: chunks rank and 2*cp-1-rank."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 * context_parallel_degree = {2 * cp}")
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat((torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)))


def shard_zigzag(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `t` along `dim` (the sequence), in zigzag order."""
    return t.index_select(dim, zigzag_index(t.shape[dim], cp, rank, t.device))


@functools.cache
def _rank_order(seq_len: int, cp: int, device: torch.device) -> torch.Tensor:
    """Positions in the row of rank 0's zigzag tokens, then rank 1's, ...: the order an all-gather concatenates
    them in (cached: every mixer of every forward uses it)."""
    return torch.cat([zigzag_index(seq_len, cp, r) for r in range(cp)]).to(device)


@functools.cache
def _natural_order(seq_len: int, cp: int, device: torch.device) -> torch.Tensor:
    """Index that puts the ranks' concatenated zigzag tokens back in row order."""
    return torch.argsort(_rank_order(seq_len, cp, device))


class CPContext:
    """One CP group: its size, this rank's place in it, and the sequence exchanges over it."""

    def __init__(self, mesh: DeviceMesh):
        self.size, self.rank = mesh.size(), mesh.get_local_rank()
        self.group = mesh.get_group()

    def gather_sequence(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """(..., S/cp, ...) local zigzag tokens -> (..., S, ...) whole rows in natural order."""
        gathered = all_gather(x.movedim(dim, 0), self.group)  # rank 0's tokens, rank 1's, ...
        order = _natural_order(gathered.shape[0], self.size, gathered.device)
        return gathered.index_select(0, order).movedim(0, dim)

    def scatter_sequence(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """(..., S, ...) partial sums in natural order -> this rank's zigzag tokens of their sum over the group."""
        x = x.movedim(dim, 0)
        by_rank = x.index_select(0, _rank_order(x.shape[0], self.size, x.device))
        return reduce_scatter_sum(by_rank, self.group).movedim(0, dim)

    def token_index(self, seq_len: int, device) -> torch.Tensor:
        """(S/cp,) positions of this rank's tokens within a row of `seq_len` tokens."""
        return zigzag_index(seq_len, self.size, self.rank, device)

    def shard_rows(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's zigzag share of every (B, S) tensor of a batch of whole rows."""
        return {key: shard_zigzag(value, self.size, self.rank) for key, value in batch.items()}

    def rows_layout(self, position_ids: torch.Tensor, packed: bool = False, segments: bool = False) -> DocumentLayout:
        """The document layout of this rank's share of whole rows with (B, S) `position_ids` (`packed`: as
        documents.document_layout's). `segments`: also cut this rank's queries into flash attention's varlen
        segments now (the trainer, on the host: no GPU sync), rather than in the first attention layer."""
        index = self.token_index(position_ids.shape[1], position_ids.device)
        layout = context_parallel_layout(position_ids[:, index], position_ids, index, packed)
        if segments:
            layout.cp_segments = context_parallel_segments(layout)
        return layout

    def local_layout(self, position_ids: torch.Tensor) -> DocumentLayout:
        """The document layout of this rank's share of the rows, from its (B, S/cp) position ids (one all-gather of
        integers)."""
        return self.rows_layout(self.gather_sequence(position_ids, dim=1))
