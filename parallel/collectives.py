"""The differentiable collectives context and expert parallelism run, over dim 0, on torch 2.11 and later.

torch's functional collectives with autograd, with one addition: the gradient that reaches a collective's
backward is made contiguous first. On torch 2.11 those backwards are C++ ops that check `input.is_contiguous()`
and fail on a strided gradient, e.g. that of `movedim` on a (B > 1, S, D) output (CP with local_batch_size 2
crashed in backward on GPU; torch 2.13's Python autograd hides it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

# Renamed in torch 2.13 (the old names warn there); torch 2.11 has only the old ones. Same signatures.
_all_gather = getattr(funcol, "all_gather_single_autograd", funcol.all_gather_tensor_autograd)
_reduce_scatter = getattr(funcol, "reduce_scatter_single_autograd", funcol.reduce_scatter_tensor_autograd)
_all_to_all = funcol.all_to_all_single_autograd


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; backward passes the gradient on contiguous (a no-op copy when it already is)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(n, ...) on each rank -> (ranks * n, ...): rank 0's rows, rank 1's, ... (backward: reduce-scatter)."""
    return _ContiguousGrad.apply(_all_gather(x.contiguous(), 0, group))


def reduce_scatter_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(ranks * n, ...) on each rank -> (n, ...): this rank's block of the sum over ranks (backward: all-gather)."""
    return _ContiguousGrad.apply(_reduce_scatter(x.contiguous(), "sum", 0, group))


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """Rows input_splits[r] of x go to rank r; output_splits[r] rows come from it (backward: the mirror one)."""
    return _ContiguousGrad.apply(_all_to_all(x.contiguous(), output_splits, input_splits, group))
