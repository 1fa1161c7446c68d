"""torch's Adam/AdamW with a CUDA step of one Triton kernel for all parameters (adam_step_triton.py).

The kernel is one plain elementwise pass over every parameter in one launch; with the kept bf16 weight copies it
writes (below) it is ahead of torch's fused AdamW end to end (docs/performance.md, "Hand-written pieces against the
libraries"; the step alone: benchmarks/tools/optimizer_step.py). A launch per parameter is bound by the host
(docs/performance.md, "Tried, not kept").
The math, the state (step, exp_avg, exp_avg_sq) and so the state dict and checkpoints are torch's. `grad_scale`
(a device scalar every gradient is divided by as it is read, as in torch's fused step) carries the gradient
clipping without a pass of its own (parallel/grad_norm.py). Tensors the kernel does not take (off CUDA, not fp32,
not contiguous) get the same math from torch's ops (torch's single-tensor Adam).

`weight_copies` (parallel/one_device_precision.py, one GPU): the kernel also writes each updated parameter's kept copy
in the compute dtype (2 bytes per parameter), so the forward reads it instead of casting the weight. The kernel
writes the parameter without bumping its version counter, which is what tells the copy current; the torch path
bumps it, and the copy is then recast before the model's next forward. Where the copies hold the gradients
(`grads_in_copies`), the step reads a weight's gradient from its copy, in the compute dtype, and `zero_grad`
clears those too.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from .adam_step_inputs import KERNEL_ALIGNMENT, fits_kernel_dtypes


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class FastAdam(torch.optim.Adam):
    """torch.optim.Adam (decoupled_weight_decay=True: AdamW); no amsgrad, maximize or complex parameters."""

    applies_grad_scale = True  # divides every gradient by `grad_scale` as it reads it (the gradient clipping's)

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
            todo = []  # (parameter, gradient, state)
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
                todo.append((p, grad, state))
            if not todo:
                continue
            steps = [state["step"] for _, _, state in todo]
            torch._foreach_add_(steps, 1)
            # One launch per batch of kernel tensors that share a step count and the gradients' and copies' dtypes
            # (one per group in practice): a launch per parameter costs host time for each (docs/performance.md,
            # "Tried, not kept").
            batches: dict[tuple, list] = {}
            for (p, grad, state), step in zip(todo, [step.item() for step in steps]):
                tensors = [_local(t) for t in (p, grad, state["exp_avg"], state["exp_avg_sq"])]
                if all(t.is_cuda and t.is_contiguous() for t in tensors) and fits_kernel_dtypes(*tensors):
                    copy = None if self.weight_copies is None else self.weight_copies.copy_of(p)
                    # (an unaligned tensor would make its whole launch unvectorised: it goes in a launch of its own)
                    aligned = all(t.data_ptr() % KERNEL_ALIGNMENT == 0
                                  for t in (*tensors, *([copy] if copy is not None else [])))
                    key = (step, tensors[0].device, tensors[1].dtype, None if copy is None else copy.dtype, aligned)
                    if key not in batches:
                        batches[key] = [self._hyper(group, step), [], [], [], [], []]
                    for column, t in zip(batches[key][1:], (*tensors, copy)):
                        column.append(t)
                else:
                    adam_step_torch_(*tensors, **self._hyper(group, step))
            for hyper, params, grads, exp_avgs, exp_avg_sqs, copies in batches.values():
                _triton_steps()(params, grads, exp_avgs, exp_avg_sqs, None if copies[0] is None else copies, **hyper)
        return None

    def _hyper(self, group: dict, step: float) -> dict:
        beta1, beta2 = group["betas"]
        return dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], decoupled=group["decoupled_weight_decay"],
                    bias_correction1=1 - beta1 ** step, bias_correction2_sqrt=math.sqrt(1 - beta2 ** step),
                    grad_scale=self.grad_scale)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The parameters' gradients as torch's, and the weight copies' (always to None)."""
        super().zero_grad(set_to_none)
        if self.weight_copies is not None:
            self.weight_copies.zero_grad()


def _triton_steps():
    from .adam_step_triton import adam_steps_  # lazy: Triton needs a GPU, and CPU installs may lack it

    return adam_steps_


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
