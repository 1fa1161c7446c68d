"""Parameters kept whole on every rank of the FSDP mesh rather than sharded: each Gated DeltaNet layer's fp32
parameters (the SSM gate's A_log and dt_bias, the gated norm's weight; docs/design.md, fp32 contract), and the
final norm's weight (parallel/parallelize.py, apply_fsdp).

They are ~200 values per layer. As an FSDP unit of their own (an fp32 policy, since the blocks' bf16 policy would
round them) they cost, per layer and step, an all-gather, a reduce-scatter and FSDP's hooks on the host, a large
share of FSDP's host time in a forward whose host already runs behind the GPU (docs/performance.md, "Tried, not
kept"); and each collective is a point where the ranks wait for each other. Whole on every rank they need no
gather and stay fp32 by construction; their gradients are averaged over the mesh as FSDP averages the rest, with
one all-reduce of all of them when the backward ends.

Every rank holds the same values: the initial weights are drawn per parameter name (init.py), and a checkpoint
or HF load gives every rank the whole tensor. The optimizer then updates identical replicas with identical
(averaged) gradients, and the gradient norm counts them once (plain tensors, parallel/grad_norm.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


class ReplicatedParams:
    """Averages the gradients of `modules`' own parameters (whole on every rank of `mesh`) over the mesh at the end
    of each backward that gave any of them a gradient, as FSDP averages its units' (a parameter without one counts
    as zeros). `model`: the module whose forward uses them."""

    def __init__(self, model: nn.Module, modules: list[nn.Module], mesh: DeviceMesh):
        self.owners = [(module, name) for module in modules for name, _ in module.named_parameters(recurse=False)]
        self.mesh = mesh
        self._queued = False
        model.register_forward_pre_hook(self._hook_params)

    @property
    def params(self) -> list[nn.Parameter]:
        return [module._parameters[name] for module, name in self.owners]

    def _hook_params(self, *_) -> None:
        """Hook the parameters the forward is about to use: materialising a model built on the meta device
        (`to_empty`) replaces its parameter objects, and with them any hook registered before."""
        self._queued = False  # a backward that raised never ran its callback
        for param in self.params:
            if not getattr(param, "_averaged_over_replicas", False):
                param.register_post_accumulate_grad_hook(self._queue)
                param._averaged_over_replicas = True

    def _queue(self, param: torch.Tensor) -> None:
        if not self._queued:  # once per backward: the callback runs when the engine has finished it
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._average)

    @torch.no_grad()
    def _average(self) -> None:
        self._queued = False
        params = self.params
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        flat = torch.cat([param.grad.reshape(-1) for param in params])
        for dim in range(self.mesh.ndim):  # summed over every mesh dimension (HSDP: replicas and shards)
            dist.all_reduce(flat, group=self.mesh.get_group(dim))
        flat /= self.mesh.size()
        for param, grad in zip(params, flat.split([param.numel() for param in params])):
            param.grad.copy_(grad.view_as(param))
