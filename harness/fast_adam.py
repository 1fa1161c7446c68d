"""torch's Adam/AdamW with a CUDA step of one Triton kernel per parameter (adam_step_kernel.py).

torch's fused AdamW (multi_tensor_apply) streamed our 2.1B fp32 parameters at about 1.4 TB/s on an H200 (41 ms of
a 231 ms step, benchmarks/hf_baseline.py with 8 layers), a third of the memory's bandwidth, for a pass that only
reads four fp32 tensors and writes three. A plain elementwise kernel per parameter streams close to the bandwidth.
The math, the state (step, exp_avg, exp_avg_sq) and so the state dict and checkpoints are torch's. `grad_scale`
(a device scalar every gradient is divided by as it is read, as in torch's fused step) carries the gradient
clipping without a pass of its own (parallel/grad_norm.py). Off CUDA, torch's own step runs.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class FastAdam(torch.optim.Adam):
    """torch.optim.Adam (decoupled_weight_decay=True: AdamW); no amsgrad, maximize or complex parameters."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float = 0.0,
                 decoupled_weight_decay: bool = True):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False,
                         decoupled_weight_decay=decoupled_weight_decay)
        self.grad_scale: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("FastAdam.step: closures are not supported")
        if not any(p.grad is not None and p.is_cuda for g in self.param_groups for p in g["params"]):
            if self.grad_scale is not None:
                raise ValueError("FastAdam.step: grad_scale is applied by the CUDA step only")
            return super().step()
        from .adam_step_kernel import adam_step_

        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # as torch's non-fused Adam initialises it: the step a host scalar, read without a sync
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if state["step"].is_cuda:  # resumed from torch's fused AdamW, which keeps it on the GPU: read once
                    state["step"] = state["step"].cpu()
                state["step"] += 1
                step = state["step"].item()
                adam_step_(_local(p), _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                           lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                           weight_decay=group["weight_decay"], decoupled=group["decoupled_weight_decay"],
                           bias_correction1=1 - beta1 ** step, bias_correction2_sqrt=math.sqrt(1 - beta2 ** step),
                           grad_scale=self.grad_scale)
        return None
