"""What a training step does with the gradients after its backward (the model's `gradients` hook,
models/qwen35_moe/hooks.py, set by the parallelize function): under expert parallelism the routed experts' gradients
averaged over the EP group (expert_parallel.py), then every tensor that holds a gradient (the parameters and, on one
GPU, the weight copies: one_device_precision.py) clipped to their global norm (grad_norm.py). The trainer calls it and
knows none of the parallel layout."""

from __future__ import annotations

import torch
from torch import nn

from .expert_parallel import scale_expert_gradients
from .grad_norm import clip_grad_norm_
from .one_device_precision import gradient_holders


class StepGradients:
    """The gradient step of a model whose routed experts are split over `ep` ranks (1: none)."""

    def __init__(self, ep: int = 1):
        self.ep = ep

    def finish(self, model: nn.Module, max_norm: float, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        if self.ep > 1:
            scale_expert_gradients(model, self.ep)
        # An optimizer that applies its `grad_scale` as it reads each gradient (FastAdam) takes the clipping over:
        # no pass of its own over every fp32 gradient
        scaling = optimizer if getattr(optimizer, "applies_grad_scale", False) else None
        return clip_grad_norm_(gradient_holders(model), max_norm, scaling_optimizer=scaling)
