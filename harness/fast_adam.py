"""torch's Adam/AdamW with a CUDA step of one Triton kernel per parameter (adam_step_kernel.py).

On an H200, over the 2.1B fp32 parameters of benchmarks/hf_baseline.py's 8-layer model, torch's fused AdamW
(multi_tensor_apply) took 17.6 ms alone (3.3 TB/s) and 35-41 ms inside a profiled training step; this kernel, one
plain elementwise pass per parameter, took 14.9 ms alone (3.9 TB/s, benchmarks/optimizer_step.py).
The math, the state (step, exp_avg, exp_avg_sq) and so the state dict and checkpoints are torch's. `grad_scale`
(a device scalar every gradient is divided by as it is read, as in torch's fused step) carries the gradient
clipping without a pass of its own (parallel/grad_norm.py). Tensors the kernel does not take (off CUDA, not fp32,
not contiguous) get the same math from torch's ops (torch's single-tensor Adam).

`weight_copies` (models/qwen35_moe/linear.py, one GPU): the kernel also writes each updated parameter's kept copy
in the compute dtype (2 bytes per parameter), so the forward reads it instead of casting the weight. The kernel
writes the parameter without bumping its version counter, which is what tells the copy current; the torch path
bumps it, and the model then recasts the copy before its next forward. Where the copies hold the gradients
(`grads_in_copies`), the step reads a weight's gradient from its copy, in the compute dtype, and `zero_grad`
clears those too.
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
                 decoupled_weight_decay: bool = True, weight_copies=None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False,
                         decoupled_weight_decay=decoupled_weight_decay)
        self.grad_scale: torch.Tensor | None = None
        self.weight_copies = weight_copies

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("FastAdam.step: closures are not supported")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                grad = p.grad if self.weight_copies is None else self.weight_copies.grad_of(p)
                if grad is None:
                    continue
                state = self.state[p]
                if not state:  # as torch's non-fused Adam initialises it: the step a host scalar, read without a sync
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if state["step"].device.type != "cpu":  # resumed from torch's fused AdamW (step on the GPU): once
                    state["step"] = state["step"].cpu()
                state["step"] += 1
                step = state["step"].item()
                tensors = [_local(t) for t in (p, grad, state["exp_avg"], state["exp_avg_sq"])]
                on_kernel = all(t.is_cuda and t.is_contiguous() for t in tensors) and fits_kernel_dtypes(*tensors)
                hyper = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                             weight_decay=group["weight_decay"], decoupled=group["decoupled_weight_decay"],
                             bias_correction1=1 - beta1 ** step, bias_correction2_sqrt=math.sqrt(1 - beta2 ** step),
                             grad_scale=self.grad_scale)
                if on_kernel:
                    copy = None if self.weight_copies is None else self.weight_copies.copy_of(p)
                    _triton_step()(*tensors, **hyper, copy=copy)
                else:
                    adam_step_torch_(*tensors, **hyper)
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The parameters' gradients as torch's, and the weight copies' (always to None)."""
        super().zero_grad(set_to_none)
        if self.weight_copies is not None:
            self.weight_copies.zero_grad()


def fits_kernel_dtypes(param, grad, exp_avg, exp_avg_sq) -> bool:
    """The kernel's dtypes (adam_step_kernel.py checks its inputs with this too): fp32, the gradient also bf16 or
    fp16 (a weight copy's)."""
    return (all(t.dtype == torch.float32 for t in (param, exp_avg, exp_avg_sq))
            and grad.dtype in (torch.float32, torch.bfloat16, torch.float16))


def _triton_step():
    from .adam_step_kernel import adam_step_  # lazy: Triton needs a GPU, and CPU installs may lack it

    return adam_step_


def adam_step_torch_(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, decoupled,
                     bias_correction1, bias_correction2_sqrt, grad_scale) -> None:
    """The kernel's step with torch's ops, in place, for any device, dtype and layout (torch's single-tensor Adam)."""
    grad = grad.to(param.dtype)  # a half-precision gradient kept in a weight copy: the math in the weight's dtype
    if grad_scale is not None:
        grad = grad / grad_scale
    if weight_decay != 0:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
