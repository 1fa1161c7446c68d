"""The model's one mixed-precision rule: a module computes in the dtype of its input activations and casts its
weights to it where they differ. Under FSDP's bf16 policy the gathered weights already are bf16 and the casts
do nothing; on one GPU, where the model is not sharded at all, the fp32 weights are cast at each use (their
gradients flow back through the cast in fp32). The fp32-contract modules (fp32_contract.py) upcast instead.

Kept copies (one GPU): casting the fp32 weights at each use reads 4 and writes 2 bytes per parameter every step
(docs/performance.md, "Hand-written pieces against the libraries": FastAdam's row). `WeightCopies` gives
each weight it covers a copy in the compute dtype, which the optimizer rewrites as it updates the weight
(harness/optim/fast_adam.py, 2 bytes per parameter) and which is then read in place of the cast. A copy is only used
while it is current: any other in-place change of the weight (a checkpoint or HF load, an init, another optimizer)
bumps the weight's version counter, and the model's forward recasts the copies whose weight changed
(`WeightCopies.refresh`).

Gradients: by default they flow to the fp32 weight as through the cast (cast to fp32 by the backward). With
`grads_in_copies` the copy itself is the leaf autograd differentiates: its gradient stays in the compute dtype in
`copy.grad` and the weight gets none. The fp32 gradient would only hold that bf16 value upcast, so where each
step has one backward this is the same gradient in half the bytes, and it spares the cast (in the 8-layer,
32-expert benchmark model 1.09B parameters, all but the lm_head's, whose fp32 gradient the loss returns itself:
per parameter the cast's 6 bytes and 2 of the 4 the gradient norm and the optimizer each read; docs/performance.md,
"Tried, not kept"). The trainer asks for it only without gradient accumulation, where a sum of backwards in bf16
would round.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _KeptCopy(torch.autograd.Function):
    """The weight's copy in place of weight.to(dtype): the copy's values forward, the gradient to the weight in the
    weight's dtype (as the cast's backward gives it)."""

    @staticmethod
    def forward(ctx, weight, copy):
        ctx.dtype = weight.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


def weight_in(module: nn.Module, name: str, dtype: torch.dtype) -> torch.Tensor:
    """The module's weight `name` in `dtype`: its kept copy when it has one in that dtype, else a cast."""
    weight, copy = getattr(module, name), getattr(module, name + "_copy", None)
    if copy is not None and copy.dtype == dtype:
        return copy if copy.requires_grad else _KeptCopy.apply(weight, copy)
    return weight.to(dtype)


class WeightCopies:
    """The kept copies of a model's weights in `dtype`: every weight named in a module's `copied_weights` (Linear's,
    the routed experts') gets one, as the buffer `<name>_copy` (not in the state dict). For plain (unsharded)
    parameters: one GPU. Each weight's version is recorded when its copy is made from it. `grads_in_copies`: the
    backward leaves each weight's gradient in its copy's `.grad`, in `dtype` (see the module's docstring)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, grads_in_copies: bool = False):
        self.model, self.dtype, self.grads_in_copies = model, dtype, grads_in_copies
        self.make()

    @torch.no_grad()
    def make(self) -> None:
        """(Re)make every copy from its weight (also after the model's parameters were replaced, e.g. by `.to()`)."""
        self.pairs: list[tuple[nn.Parameter, torch.Tensor]] = []
        for module in self.model.modules():
            for name in getattr(module, "copied_weights", ()):
                weight = getattr(module, name)
                copy = weight.detach().to(self.dtype, copy=True).requires_grad_(self.grads_in_copies)
                setattr(module, name + "_copy", copy)
                self.pairs.append((weight, copy))
        self.versions = [weight._version for weight, _ in self.pairs]
        self.by_weight = dict(self.pairs)

    def copy_of(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The kept copy of `weight`, which an optimizer updating the weight in place without bumping its version
        counter (FastAdam's kernel) must rewrite along with it; None if it has none."""
        return self.by_weight.get(weight)

    def grad_of(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The weight's gradient: its own, else (grads_in_copies) its copy's, in the copy's dtype."""
        copy = self.by_weight.get(weight)
        return weight.grad if weight.grad is not None or copy is None else copy.grad

    def gradient_holders(self) -> list[torch.Tensor]:
        """The copies that hold gradients (grads_in_copies), for whatever reads every gradient (the norm)."""
        return [copy for _, copy in self.pairs if copy.requires_grad]

    def zero_grad(self) -> None:
        for _, copy in self.pairs:
            copy.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """Recast the copies whose weight changed in place since they were made (the model's forward calls it)."""
        for i, (weight, copy) in enumerate(self.pairs):
            if weight._version != self.versions[i]:
                copy.copy_(weight)
                self.versions[i] = weight._version


class Linear(nn.Linear):
    """nn.Linear in its input's dtype (same parameters and state-dict keys)."""

    copied_weights = ("weight",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("weight_copy", None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, weight_in(self, "weight", x.dtype), bias)
