"""One GPU's mixed precision: the weights stay whole fp32 parameters (what the optimizer updates and checkpoints
hold) and the blocks compute in `dtype` (bf16), as FSDP2's bf16 policy has them compute, without FSDP's gathers
and hooks (docs/design.md, "Parallelism"). It enters the model through the extension point the model declares
(`mixed_precision`, models/qwen35_moe/hooks.py): the embedding's rows are cast to `dtype`, every module then
computes in its input's dtype, and each Linear and the routed experts read their weights through the reader given
here.

Kept copies: casting the fp32 weights at each use reads 4 and writes 2 bytes per parameter every step
(docs/performance.md, "Hand-written pieces against the libraries": FastAdam's row). With `kept_copies` each weight of
two or more dimensions that those modules hold gets a copy in `dtype`, held here, which the optimizer rewrites as it
updates the weight (harness/optim/fast_adam.py, 2 bytes per parameter) and which the forward reads in place of the
cast. A copy is read only while it is current: as each forward starts (`before_forward`), the copies whose weight
changed in place since (a checkpoint or HF load, an init, another optimizer: its version counter moved) are recast,
and a weight replaced by another tensor (`to_empty`, `.to()`) gets a new copy. FastAdam's kernel writes a weight
without moving its version counter, so its copy stays current.

Gradients: by default they flow to the fp32 weight as through the cast (cast to fp32 by the backward). With
`grads_in_copies` the copy itself is the leaf autograd differentiates: its gradient stays in `dtype` in `copy.grad`
and the weight gets none. The fp32 gradient would only hold that bf16 value upcast, so where each step has one
backward this is the same gradient in half the bytes, and it spares the cast (in the 8-layer, 32-expert benchmark
model 1.09B parameters, all but the lm_head's, whose fp32 gradient the loss returns itself: per parameter the
cast's 6 bytes and 2 of the 4 the gradient norm and the optimizer each read; docs/performance.md, "Tried, not
kept"). The trainer asks for it only without gradient accumulation, where a sum of backwards in bf16 would round;
`gradient_holders` then names the copies among the tensors that hold the model's gradients.
"""

from __future__ import annotations

import operator

import torch
from torch import nn

from .torch_internals import own_parameters, version_counters


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


class KeptCopies:
    """One module's reader (models/qwen35_moe/hooks.WeightReader): each of its weights read as its kept copy when the
    copy is in the dtype asked for, else cast."""

    def __init__(self):
        self.copies: dict[str, torch.Tensor] = {}  # weight name -> its copy (OneDevicePrecision makes them)

    def read(self, module: nn.Module, name: str, dtype: torch.dtype) -> torch.Tensor:
        weight, copy = getattr(module, name), self.copies.get(name)
        if copy is not None and copy.dtype == dtype:
            return copy if copy.requires_grad else _KeptCopy.apply(weight, copy)
        return weight.to(dtype)


class OneDevicePrecision:
    """models/qwen35_moe/hooks.MixedPrecision for a model whose parameters are whole on this device: it computes in
    `dtype`; with `kept_copies`, from copies of its weights in `dtype` (the module docstring), holding the weights'
    gradients with `grads_in_copies`."""

    def __init__(self, dtype: torch.dtype, kept_copies: bool = True, grads_in_copies: bool = False):
        self.dtype, self.kept_copies, self.grads_in_copies = dtype, kept_copies, grads_in_copies
        self._readers: dict[nn.Module, KeptCopies] = {}
        # One entry per copied weight, in the same order: where the module keeps it, its name, its module's reader
        self._slots: list[tuple[dict, str, KeptCopies]] = []
        # As the copies were last made or recast: each weight, its storage, its version counter, and its copy
        self._weights: list[nn.Parameter] = []
        self._storage: list[int] = []
        self._versions: list[int] = []
        self._copies: list[torch.Tensor] = []
        self._copy_by_weight: dict[nn.Parameter, torch.Tensor] = {}

    def reader(self, module: nn.Module) -> KeptCopies | None:
        """The reader of `module`'s weights of two or more dimensions (its own: a Linear's, the routed experts');
        None without kept copies (the module casts its weights)."""
        if not self.kept_copies:
            return None
        if module not in self._readers:
            self._readers[module] = reader = KeptCopies()
            parameters = own_parameters(module)
            # none of a weight already held in `dtype` (a frozen base under LoRA): it is read as it is; none of one
            # held in FP8 (models/qwen35_moe/fp8_hold.py): its module dequantizes it where it is used
            self._slots += [(parameters, name, reader) for name, p in parameters.items()
                            if p is not None and p.ndim >= 2 and p.dtype not in (self.dtype, torch.float8_e4m3fn)]
        return self._readers[module]

    def before_forward(self) -> None:
        """Make the copies current: new ones for weights replaced (or moved to other storage) since they were made,
        in-place changes recast."""
        if not self._slots:
            return
        weights = [parameters[name] for parameters, name, _ in self._slots]
        if (len(weights) != len(self._weights) or not all(map(operator.is_, weights, self._weights))
                or list(map(torch.Tensor.data_ptr, weights)) != self._storage):
            self._make(weights)
            return
        versions = version_counters(weights)
        if versions != self._versions:
            with torch.no_grad():
                for copy, weight, made, now in zip(self._copies, weights, self._versions, versions):
                    if now != made:
                        copy.copy_(weight)
            self._versions = versions

    @torch.no_grad()
    def _make(self, weights: list[nn.Parameter]) -> None:
        self._copies = [weight.detach().to(self.dtype, copy=True).requires_grad_(
            self.grads_in_copies and weight.requires_grad) for weight in weights]
        for (_, name, reader), copy in zip(self._slots, self._copies):
            reader.copies[name] = copy
        self._weights, self._storage = weights, [weight.data_ptr() for weight in weights]
        self._versions = version_counters(weights)
        self._copy_by_weight = dict(zip(weights, self._copies))

    @property
    def pairs(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(weight, its copy) for every copy, as last made."""
        return list(zip(self._weights, self._copies))

    def copy_of(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The kept copy of `weight`, which an optimizer updating the weight in place without moving its version
        counter (FastAdam's kernel) must rewrite along with it; None if it has none."""
        return self._copy_by_weight.get(weight)

    def grad_of(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The weight's gradient: its own, else (grads_in_copies) its copy's, in the copy's dtype."""
        copy = self._copy_by_weight.get(weight)
        return weight.grad if weight.grad is not None or copy is None else copy.grad

    def gradient_holders(self) -> list[torch.Tensor]:
        """The copies that hold gradients (grads_in_copies)."""
        return [copy for copy in self._copies if copy.requires_grad]

    def zero_grad(self) -> None:
        for copy in self._copies:
            copy.grad = None


def weight_copies_of(model: nn.Module) -> OneDevicePrecision | None:
    """The hook keeping `model`'s weight copies, which an optimizer must rewrite as it updates the weights; None where
    there are none (FSDP, CPU, copies off)."""
    precision = getattr(model, "mixed_precision", None)
    return precision if isinstance(precision, OneDevicePrecision) and precision.kept_copies else None


def gradient_holders(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor that holds a gradient of `model`: its parameters and, with grads_in_copies, the weight copies
    (for what reads every gradient: the norm and its clipping)."""
    copies = weight_copies_of(model)
    return [*model.parameters(), *(copies.gradient_holders() if copies is not None else ())]
