"""The merged export of a LoRA model: each adapted base weight written as W + s * B A, the adapters never.

A model with adapters (models/qwen35_moe/lora.py) has, beside each adapted weight, its adapter's two factors:
  `<module>.weight` (out, in)          `<module>.adapter.lora_A` (rank, in), `<module>.adapter.lora_B` (out, rank)
  `<experts>.gate_up_proj` (E, 2I, D)  `<experts>.adapter.gate_up_A` (E, rank, D), `gate_up_B` (E, 2I, rank)
  `<experts>.down_proj` (E, D, I)      `<experts>.adapter.down_A` (E, rank, I), `down_B` (E, D, rank)
(the router's `<gate>.weight` (E, D) is a dense one). `merged_reads` turns a reader of whole native tensors (gathered
under FSDP in the end-of-run export, read from the checkpoint and the base in the converter) into one that gives each
adapted weight merged: W read and copied to fp32 (at least), s * B A added into that copy in place (addmm / baddbmm,
per expert for the experts: no (out, in) product beside it), then cast to the export dtype. One weight at a time:
beside what the export holds, its base tensor, the fp32 copy and its A and B.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from models.qwen35_moe import Qwen35MoeArgs, Qwen35MoeModel
from models.qwen35_moe.init import canonical_name
from models.qwen35_moe.lora import LoraArgs, add_adapters, adapted_modules

ADAPTER = ".adapter."
# an adapter's A factor -> the base weight it updates, beside the adapter's module
_WEIGHT_OF_A = {"lora_A": "weight", "gate_up_A": "gate_up_proj", "down_A": "down_proj"}


def is_adapter_key(key: str) -> bool:
    return ADAPTER in key


@dataclass(frozen=True)
class Merge:
    """An adapted base weight's adapter: the state-dict keys of its A and B, and its scale s = alpha / rank."""
    a: str
    b: str
    scale: float


def adapter_merges(keys: Iterable[str], scale: Callable[[str], float]) -> dict[str, Merge]:
    """{base weight key: its Merge} for every adapter among native state-dict keys; `scale(module)` gives the scale of
    the adapter of that module."""
    merges = {}
    for key in keys:
        module, sep, name = key.rpartition(ADAPTER)
        if sep and name in _WEIGHT_OF_A:
            merges[f"{module}.{_WEIGHT_OF_A[name]}"] = Merge(key, f"{module}{ADAPTER}{name[:-1]}B", scale(module))
    return merges


def model_merges(model: nn.Module, keys: Iterable[str]) -> dict[str, Merge]:
    """adapter_merges of a model's state-dict keys, each with the scale its module's adapter holds."""
    keys = list(keys)
    if not any(map(is_adapter_key, keys)):
        return {}
    scales = {canonical_name(name): module.adapter.scale for name, module in adapted_modules(model)}
    return adapter_merges(keys, scales.__getitem__)


def merged_reads(read: Callable[[str], torch.Tensor], merges: dict[str, Merge],
                 dtype: torch.dtype) -> Callable[[str], torch.Tensor]:
    """`read` (native key -> whole tensor), but an adapted weight comes merged, W + s * B A computed in fp32 (float64
    for a float64 model) and cast to `dtype` (the export's: no adapted weight is one of the fp32 contract's). Every
    call reads the same keys in the same order on every rank (`read` may run collectives): W, then A, then B."""

    def read_merged(key: str) -> torch.Tensor:
        merge = merges.get(key)
        if merge is None:
            return read(key)
        weight = read(key)
        a, b = read(merge.a), read(merge.b)
        compute = torch.promote_types(a.dtype, torch.float32)
        merged = weight.to(compute, copy=True)  # never the model's own tensor, whatever its dtype
        del weight
        a, b = a.to(compute), b.to(compute)
        if merged.ndim == 3:  # per expert: (E, out, in) += s * (E, out, r) @ (E, r, in)
            merged.baddbmm_(b, a, alpha=merge.scale)
        else:
            merged.addmm_(b, a, alpha=merge.scale)
        return merged.to(dtype)

    return read_merged


def expected_adapter_shapes(args: Qwen35MoeArgs, lora: LoraArgs) -> dict[str, tuple[int, ...]]:
    """Every adapter key (with its shape) that a model of `args` with the adapters `lora` describes has (meta device)."""
    with torch.device("meta"):
        model = Qwen35MoeModel(args)
        add_adapters(model, lora)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if is_adapter_key(k)}
