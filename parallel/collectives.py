"""The differentiable collectives context and expert parallelism run, over dim 0, on torch 2.11 and later.

torch's functional collectives with autograd, with two additions (`_Waited`): what leaves a collective, forward
or backward, is a finished plain tensor, never a pending one; and the gradient that reaches a collective's
backward is made contiguous first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

# Renamed in torch 2.13 (the old names warn there); torch 2.11 has only the old ones. Same signatures.
_all_gather = getattr(funcol, "all_gather_single_autograd", funcol.all_gather_tensor_autograd)
_reduce_scatter = getattr(funcol, "reduce_scatter_single_autograd", funcol.reduce_scatter_tensor_autograd)
_all_to_all = funcol.all_to_all_single_autograd


def _waited(t: torch.Tensor) -> torch.Tensor:
    """t, or the finished tensor under it if t is a collective's pending result (funcol's AsyncCollectiveTensor)."""
    return t.trigger_wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


class _Waited(torch.autograd.Function):
    """Identity, except that a collective's pending result is waited for, in forward (its output) and in backward
    (its gradient), and the gradient is passed on contiguous.

    Eager ops wait for a pending result themselves, but a compiled graph fed one (compile.enable, with EP's
    exchange running eagerly between two graphs) reads the buffer under it without waiting: gradients came out
    wrong. The contiguous gradient: torch 2.11's collective backwards are C++ ops that check
    `input.is_contiguous()` and fail on a strided gradient, e.g. that of `movedim` on a (B > 1, S, D) output
    (CP with local_batch_size 2 crashed in backward on GPU; torch 2.13's Python autograd hides it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = _waited(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _waited(grad).contiguous()


def _collective(op, x: torch.Tensor, *args) -> torch.Tensor:
    """op(x, *args) with plain, finished tensors going out both ways (see _Waited)."""
    return _Waited.apply(op(_Waited.apply(x.contiguous()), *args))


def all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(n, ...) on each rank -> (ranks * n, ...): rank 0's rows, rank 1's, ... (backward: reduce-scatter)."""
    return _collective(_all_gather, x, 0, group)


def reduce_scatter_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(ranks * n, ...) on each rank -> (n, ...): this rank's block of the sum over ranks (backward: all-gather)."""
    return _collective(_reduce_scatter, x, "sum", 0, group)


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int],
               group: dist.ProcessGroup) -> torch.Tensor:
    """Rows input_splits[r] of x go to rank r; output_splits[r] rows come from it (backward: the mirror one)."""
    return _collective(_all_to_all, x, output_splits, input_splits, group)
