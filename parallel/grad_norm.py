"""Gradient-norm clipping over parameters sharded on different meshes.

torch's `clip_grad_norm_` stacks every gradient's norm into one tensor, which DTensors on different meshes
cannot do: under expert parallelism the experts' gradients live on the (efsdp, ep) mesh and every other
gradient on the FSDP mesh. Here the gradients are grouped by mesh and placements; each group's local tensors
(a DTensor's shard) give a sum of squares, summed over the mesh dimensions the group is sharded on (not over
those it is replicated on), and each group is scaled in place, or by the optimizer's step itself where it can
(FastAdam's grad_scale). Half-precision gradients (kept weight copies', parallel/one_device_precision.py) are
normed in fp32, as their fp32 upcasts would be.

The local norms are plain tensor ops: DTensor's own norm dispatches each gradient's ops through its Python
layer, host time at the end of the step during which the GPU, its backward done, has nothing queued
(docs/performance.md, "Tried, not kept").
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, foreach: bool = True,
                    scaling_optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """Scale the gradients so that their global L2 norm is at most `max_norm`; returns the norm before scaling
    (a plain 0-dim tensor, at least fp32, on the gradients' device, the same on every rank). No host sync.

    `scaling_optimizer`: an optimizer whose step divides every gradient by its `grad_scale` as it reads it
    (torch's fused Adam/AdamW, the hook GradScaler uses; harness.optim.fast_adam.FastAdam on CUDA). The scaling is then
    left to its next step, which spares a read and a write of every fp32 gradient. max_norm inf scales nothing."""
    groups: dict[object, list[torch.Tensor]] = {}  # (mesh, placements (None: plain tensors), dtype) -> gradients
    for p in parameters:
        if p.grad is not None:
            layout = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else (None, None)
            groups.setdefault((*layout, p.grad.dtype), []).append(p.grad)
    squares = []
    for (mesh, placements, _), grads in groups.items():
        square = _local_square_sum([g.to_local() if isinstance(g, DTensor) else g for g in grads], foreach)
        for dim, placement in enumerate(placements or ()):
            if placement.is_partial():  # pending sums: their squares' sum is not the sum's square
                raise ValueError(f"clip_grad_norm_: a gradient with pending reductions ({placements}) on {mesh}")
            if placement.is_shard():  # each rank holds a part: the parts' sums add up (not so over replicas)
                dist.all_reduce(square, group=mesh.get_group(dim))
        squares.append(square)
    total = torch.stack(squares).sum().sqrt()
    if scaling_optimizer is not None:
        scaling_optimizer.grad_scale = None
    if max_norm == float("inf"):
        return total
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)  # torch's clip_grad_norm_ coefficient
    if scaling_optimizer is not None:
        scaling_optimizer.grad_scale = coefficient.reciprocal()
        return total
    with implicit_replication():  # the plain coefficient acts as a replicated scalar against each mesh's DTensors
        for grads in groups.values():
            if foreach:
                torch._foreach_mul_(grads, coefficient)
            else:
                for grad in grads:
                    grad.mul_(coefficient)
    return total


def _local_square_sum(grads: list[torch.Tensor], foreach: bool) -> torch.Tensor:
    """The sum of squares of plain tensors of one dtype, accumulated in at least fp32 (a half-precision norm would
    round each tensor's norm to its dtype)."""
    dtype = torch.promote_types(grads[0].dtype, torch.float32)
    if foreach and all(g.is_cuda for g in grads):
        norms = torch._foreach_norm(grads, 2.0, dtype=dtype)
    else:
        norms = [torch.linalg.vector_norm(g, dtype=dtype) for g in grads]
    return torch.stack(norms).square().sum()
