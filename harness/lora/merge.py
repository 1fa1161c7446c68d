"""The merged export of a LoRA model: each adapted base weight written as W + s * B A, the adapters never.

A model with adapters has, beside each adapted weight, its adapter's two factors (their names:
models/qwen35_moe/lora_targets.py; the router's `<gate>.weight` (E, D) is a dense one). `merged_reads` turns a reader
of whole native tensors (gathered under FSDP in the end-of-run export, read from the checkpoint and the base in the
converter) into one that gives each adapted weight merged: W read and copied to fp32 (at least), s * B A added into that copy in place (addmm / baddbmm,
per expert for the experts: no (out, in) product beside it), then cast to the export dtype. One weight at a time:
beside what the export holds, its base tensor, the fp32 copy and its A and B.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from models.qwen35_moe.lora_targets import ADAPTER, WEIGHT_OF_A


@dataclass(frozen=True)
class Merge:
    """An adapted base weight's adapter: the state-dict keys of its A and B, and its scale s = alpha / rank."""
    a: str
    b: str
    scale: float


def adapter_merges(keys: Iterable[str], scale_of: Callable[[str], float]) -> dict[str, Merge]:
    """{base weight key: its Merge} for every adapter among native state-dict keys; `scale_of(A's key)`: its scale
    (LoraArgs.scale_of: the routed experts' may differ)."""
    merges = {}
    for key in keys:
        module, sep, name = key.rpartition(ADAPTER)
        if sep and name in WEIGHT_OF_A:
            merges[f"{module}.{WEIGHT_OF_A[name]}"] = Merge(key, f"{module}{ADAPTER}{name[:-1]}B", scale_of(key))
    return merges


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
