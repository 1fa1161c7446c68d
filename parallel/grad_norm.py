"""Gradient-norm clipping over parameters sharded on different meshes.

torch's `clip_grad_norm_` stacks every gradient's norm into one tensor, which DTensors on different meshes
cannot do: under expert parallelism the experts' gradients live on the (efsdp, ep) mesh and every other
gradient on the FSDP mesh. Here each mesh's gradients are reduced to their global norm (a DTensor's norm
reduces over its mesh), the norms are combined as plain tensors, and each group is scaled in place.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, foreach: bool = True) -> torch.Tensor:
    """Scale the gradients so that their global L2 norm is at most `max_norm`; returns the norm before scaling
    (a plain 0-dim tensor, at least fp32, on the gradients' device, the same on every rank). No host sync."""
    groups: dict[object, list[torch.Tensor]] = {}  # mesh (None: plain tensors) -> its gradients
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    squares = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=foreach)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares.append(norm.to(torch.promote_types(norm.dtype, torch.float32)).square())
    total = torch.stack(squares).sum().sqrt()
    with implicit_replication():  # the plain norm acts as a replicated scalar against each mesh's DTensors
        for grads in groups.values():
            torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total, foreach=foreach)
    return total
