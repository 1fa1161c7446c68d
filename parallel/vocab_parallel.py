"""Vocabulary parallelism for the embedding and the lm_head under FSDP: their weights stay sharded by vocabulary
rows over the FSDP mesh (the layout FSDP gives them, so checkpoints do not change), and the tokens travel instead.

At 35B-A3B's 248,320-token vocabulary each of the two matrices is half a billion parameters. Under FSDP every rank
gathers both (1 GiB each in bf16) and reduce-scatters their fp32 gradients (2 GiB each) every step; the embedding's
gather opens the step and its reduction closes it, with no compute to hide behind. Here each rank keeps its slice
of the rows (rank r: rows r * ceil(V / n) ...) and:

- embedding: gathers the shard group's token ids (integers), looks up the ones its slice holds (zero elsewhere),
  and a reduce-scatter sums each token's row onto the token's rank. Backward: the output gradients are gathered and
  each rank sums them into its slice's rows.
- lm_head and loss: gathers the group's final hidden states and labels and computes its slice of every gathered
  token's logits; the ranks combine per-row statistics into the loss (models/qwen35_moe/kernels/linear_cross_entropy.py),
  and a reduce-scatter sums each token's hidden-state gradient over the slices onto its rank.

Per rank and step that moves about 10 x (n x tokens per rank) x hidden bytes where FSDP moves 12 x vocab x
hidden, and none of it is the weights' casts and copies: "auto" takes it while n x tokens per rank <= vocab, where
it moves less than FSDP would (`resolve_vocab_parallel`).

Gradients come out as FSDP's would: averaged over the whole FSDP mesh (the trainer scales the loss by the world
size), and summed over the replicas of an HSDP mesh by an all-reduce.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from models.qwen35_moe.kernels.linear_cross_entropy import combine_slice_stats, scale_

from .collectives import all_gather, reduce_scatter_sum


def vocab_rows(vocab: int, ranks: int, rank: int) -> tuple[int, int]:
    """The rows [start, stop) of rank `rank` when `vocab` rows are sharded on dim 0 over `ranks` (DTensor's Shard(0),
    as FSDP2 shards: chunks of ceil(vocab / ranks), the last ones shorter or empty)."""
    size = math.ceil(vocab / ranks)
    return min(rank * size, vocab), min((rank + 1) * size, vocab)


def resolve_vocab_parallel(setting: str, vocab: int, shard_ranks: int, tokens_per_rank: int) -> bool:
    """Whether the embedding and the lm_head go vocabulary-parallel: "always" / "never", or "auto": while it moves
    fewer bytes than FSDP would (shard_ranks x tokens_per_rank <= vocab, see the module docstring). Never where a
    rank's slice would be empty (more ranks than ceil-sized chunks of the vocabulary)."""
    if shard_ranks < 2 or vocab_rows(vocab, shard_ranks, shard_ranks - 1)[0] >= vocab:
        if setting == "always" and shard_ranks >= 2:
            raise ValueError(f"parallelism.vocab_parallel = 'always': {vocab} vocabulary rows leave some of the "
                             f"{shard_ranks} FSDP ranks an empty slice")
        return False
    if setting == "auto":
        return shard_ranks * tokens_per_rank <= vocab
    return setting == "always"


class _AverageGradient(torch.autograd.Function):
    """Identity; its backward makes a slice's gradient FSDP's: averaged over the mesh, summed over HSDP replicas."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, shard: VocabShard) -> torch.Tensor:
        ctx.shard = shard
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.shard.sum_replicas(grad / ctx.shard.mesh.size()), None


class VocabShard:
    """The vocabulary-parallel exchanges of one model over its FSDP mesh ((shard,) or HSDP's (replicate, shard)):
    the embedding's lookup (`embed`), the lm_head's weight (`local`, `full`), and the exchanges the chunked cross
    entropy calls (`gather`, `combine`, `own`, `scatter_sum`, `weight_grad`; models/qwen35_moe/kernels/
    linear_cross_entropy.py). The model holds it as `vocab_parallel` (models/qwen35_moe/hooks.py)."""

    def __init__(self, mesh: DeviceMesh, vocab: int, param_dtype: torch.dtype | None):
        self.mesh, self.param_dtype = mesh, param_dtype  # FSDP's: the rows are cast to it as FSDP casts its units
        self.group = mesh.get_group(mesh.ndim - 1)
        self.size, self.rank = mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1)
        self.replicas = mesh.get_group(0) if mesh.ndim == 2 and mesh.size(0) > 1 else None
        self.start, self.stop = vocab_rows(vocab, self.size, self.rank)
        self.placements = (Replicate(), Shard(0)) if mesh.ndim == 2 else (Shard(0),)
        self.params: list[nn.Parameter] = []  # the sharded weights (shard_vocab_rows)

    # The two modules' calls.
    def embed(self, ids: torch.Tensor, weight: DTensor) -> torch.Tensor:
        """ids (...) on this rank -> (..., hidden) rows of the sharded table, in FSDP's param dtype."""
        table = _AverageGradient.apply(weight.to_local(), self)
        local = self.gather(ids.flatten()) - self.start
        here = (local >= 0) & (local < self.stop - self.start)
        rows = F.embedding(torch.where(here, local, 0), table)
        rows = torch.where(here.unsqueeze(1), rows, 0).to(self.param_dtype or rows.dtype)
        # One non-zero row per token: the sum is exact in any dtype.
        return reduce_scatter_sum(rows, self.group).view(*ids.shape, -1)

    def local(self, weight: DTensor) -> torch.Tensor:
        """This rank's rows of the lm_head's weight, its gradient made FSDP's by `weight_grad`."""
        return weight.to_local()

    def full(self, weight: DTensor) -> torch.Tensor:
        """The whole weight, gathered (logits for evaluation only)."""
        return weight.full_tensor()

    # The chunked cross entropy's hooks (linear_cross_entropy._chunked).
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(n, ...) -> (size x n, ...): every rank's x, in rank order (no gradient)."""
        return all_gather(x.detach(), self.group)

    def combine(self, stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (rows, 3) slice statistics -> every row's log-sum-exp and label logit over the vocabulary."""
        return combine_slice_stats(self.gather(stats).view(self.size, *stats.shape))

    def own(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's part of gathered rows."""
        n = rows.shape[0] // self.size
        return rows[self.rank * n:(self.rank + 1) * n]

    def scatter_sum(self, rows: torch.Tensor) -> torch.Tensor:
        """Gathered rows' partial values -> this rank's rows summed over the group."""
        return reduce_scatter_sum(rows, self.group)

    def weight_grad(self, grad: torch.Tensor, grad_total: torch.Tensor) -> torch.Tensor:
        """The lm_head slice's gradient, summed over every rank's tokens, scaled by the loss's upstream gradient,
        which must be every rank's (the trainer's is: world size / global label tokens), and made FSDP's."""
        every = self.gather(grad_total.reshape(1).to(torch.float32))
        torch._assert_async((every == every[0]).all(),
                            "vocab_parallel: the ranks' losses must get the same upstream gradient")
        return self.sum_replicas(scale_(grad, grad_total / self.mesh.size()))  # in place: the function's own

    def sum_replicas(self, grad: torch.Tensor) -> torch.Tensor:
        """A slice's gradient, already divided by the mesh's size -> FSDP's average over the mesh: summed (in place)
        over the replicas of an HSDP mesh."""
        if self.replicas is not None:
            dist.all_reduce(grad, group=self.replicas)
        return grad


def shard_vocab_rows(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None) -> VocabShard:
    """Shard the embedding and the lm_head (one parameter if tied) by rows over `mesh`, as DTensors with FSDP's
    placements (so a checkpoint is the same whichever way they train). Returns their exchanges, for the model's
    `vocab_parallel`; FSDP must leave the sharded parameters alone (`VocabShard.params`)."""
    shard = VocabShard(mesh, model.embed_tokens.num_embeddings, param_dtype)
    tied = model.lm_head.weight is model.embed_tokens.weight
    sharded = []
    for module in (model.embed_tokens,) if tied else (model.embed_tokens, model.lm_head):
        data = distribute_tensor(module.weight.data, mesh, shard.placements, src_data_rank=None)
        if data.to_local().shape[0] != shard.stop - shard.start:  # DTensor's Shard(0) is what vocab_rows assumes
            raise RuntimeError(f"vocab_parallel: rank holds {data.to_local().shape[0]} rows, expected "
                               f"{shard.stop - shard.start} ({shard.start} ... {shard.stop - 1})")
        module.weight = nn.Parameter(data, requires_grad=module.weight.requires_grad)
        sharded.append(module.weight)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    shard.params = sharded
    return shard
