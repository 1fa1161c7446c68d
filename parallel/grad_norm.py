"""Gradient-norm clipping over parameters sharded on different meshes.

torch's `clip_grad_norm_` stacks every gradient's norm into one tensor, which DTensors on different meshes
cannot do: under expert parallelism the experts' gradients live on the (efsdp, ep) mesh and every other
gradient on the FSDP mesh. Here each mesh's gradients are reduced to their global norm (a DTensor's norm
reduces over its mesh), the norms are combined as plain tensors, and each group is scaled in place, or by the
optimizer's step itself where it can (FastAdam's grad_scale). Half-precision gradients (kept weight copies',
models/qwen35_moe/linear.py) are normed in fp32, as their fp32 upcasts would be.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, foreach: bool = True,
                    scaling_optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """Scale the gradients so that their global L2 norm is at most `max_norm`; returns the norm before scaling
    (a plain 0-dim tensor, at least fp32, on the gradients' device, the same on every rank). No host sync.

    `scaling_optimizer`: an optimizer whose step divides every gradient by its `grad_scale` as it reads it
    (torch's fused Adam/AdamW, the hook GradScaler uses; harness.fast_adam.FastAdam on CUDA). The scaling is then
    left to its next step, which spares a read and a write of every fp32 gradient. max_norm inf scales nothing."""
    groups: dict[object, list[torch.Tensor]] = {}  # (mesh (None: plain tensors), half precision) -> its gradients
    for p in parameters:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault((mesh, p.grad.dtype in (torch.bfloat16, torch.float16)), []).append(p.grad)
    squares = []
    for (_, half), grads in groups.items():
        norm = _fp32_norm(grads, foreach) if half else torch.nn.utils.get_total_norm(grads, 2.0, foreach=foreach)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares.append(norm.to(torch.promote_types(norm.dtype, torch.float32)).square())
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


def _fp32_norm(grads: list[torch.Tensor], foreach: bool) -> torch.Tensor:
    """The L2 norm of half-precision gradients, accumulated and returned in fp32 (get_total_norm's would round each
    tensor's norm to the gradients' dtype)."""
    if foreach and all(g.is_cuda and not isinstance(g, DTensor) for g in grads):
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    else:
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
