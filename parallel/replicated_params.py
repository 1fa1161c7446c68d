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

import operator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .torch_internals import own_parameters, run_when_backward_ends


class ReplicatedParams:
    """Averages the gradients of `modules`' own parameters (whole on every rank of `mesh`) over the mesh at the end
    of each backward that gave any of them a gradient, as FSDP averages its units' (a parameter without one counts
    as zeros). `model`: the module whose forward uses them.

    Like FSDP's own reduction, by hooks on the parameters and on the model's forward (FSDP's root forward hook binds
    its state to the materialised parameters the same way), not through an extension point of the model: averaging
    gradients changes nothing the forward computes (docs/design.md, "Model extension points")."""

    def __init__(self, model: nn.Module, modules: list[nn.Module], mesh: DeviceMesh):
        # Where each module keeps each of its parameters (read without nn.Module's attribute lookup: every forward)
        self.slots = [(parameters, name) for parameters in map(own_parameters, modules)
                      for name, param in parameters.items() if param is not None]
        self.mesh = mesh
        self._queued = False
        self._hooked: list[nn.Parameter] = []  # the parameters whose gradient hooks are registered
        model.register_forward_pre_hook(self._hook_params)

    @property
    def params(self) -> list[nn.Parameter]:
        """The trained ones (frozen ones, e.g. under LoRA, have no gradient to average)."""
        return [parameters[name] for parameters, name in self.slots if parameters[name].requires_grad]

    def _hook_params(self, *_) -> None:
        """Hook the parameters the forward is about to use: materialising a model built on the meta device
        (`to_empty`) replaces its parameter objects, and with them any hook registered before."""
        self._queued = False  # a backward that raised never ran its callback
        params = self.params
        if len(params) == len(self._hooked) and all(map(operator.is_, params, self._hooked)):
            return
        hooked = set(map(id, self._hooked))
        for param in params:
            if id(param) not in hooked:
                param.register_post_accumulate_grad_hook(self._queue)
        self._hooked = params

    def _queue(self, param: torch.Tensor) -> None:
        if not self._queued:  # once per backward: the callback runs when the engine has finished it
            self._queued = True
            run_when_backward_ends(self._average)

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
