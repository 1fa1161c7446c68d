"""`parallelism.fsdp_reshard_after_forward = "auto"`: after a launch's first step, the blocks keep their gathered
weights from forward to backward wherever that fits in the GPU's memory, as "never" does from the start.

Keeping them saves each block's second all-gather, cast and copy-out a step, on the host and on the GPU
(docs/performance.md, "FSDP over 2 GPUs against one GPU"), for the memory of every block's gathered weights at the
step's peak. "auto" measures both on the run itself: the first step's peak of reserved memory, and the bytes the
resharding units' gathered weights take (each unit gathered once and freed, the allocator counting). The blocks
keep them when the sum fits in KEEP_FRACTION of the GPU's memory on every rank; the rest of the margin is for
steps whose routing sends more tokens to one expert than the first step's did. On CPU "auto" is "always".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .parallelize import resharding_units

KEEP_FRACTION = 0.85
GIB = 1024**3


def keep_gathered_weights(units: list[nn.Module]) -> None:
    """Each of the units (FSDP units that free their weights after forward) keeps them to the backward from now on."""
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)


def all_ranks_fit(peak: int, gathered: int, capacity: int, group: dist.ProcessGroup | None) -> bool:
    """Whether the peak plus the gathered weights fit in KEEP_FRACTION of the capacity on every rank (bytes; the
    ranks' peaks differ a little, and a unit keeps its weights on all of its ranks or on none)."""
    fits = torch.tensor([int(peak + gathered <= KEEP_FRACTION * capacity)], dtype=torch.int32)
    if group is not None:
        dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=group)
    return bool(fits.item())


class CudaMemory:
    """What the rule reads of a GPU's memory (bytes)."""

    def __init__(self, device: torch.device):
        self.device = device

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)

    def capacity(self) -> int:
        return torch.cuda.get_device_properties(self.device).total_memory


def device_memory(device: torch.device) -> CudaMemory | None:
    return CudaMemory(device) if device.type == "cuda" else None


def gathered_bytes(units: list[nn.Module], memory: CudaMemory) -> int:
    """The bytes the units' gathered weights take, measured: each unit gathered once and freed (every rank does
    the same, in the same order: these are collectives)."""
    total = 0
    for unit in units:
        before = memory.allocated()
        unit.unshard()
        total += memory.allocated() - before
        unit.reshard()
    return total


def keep_if_it_fits(model: nn.Module, device: torch.device, group: dist.ProcessGroup | None) -> str | None:
    """Run once, after a launch's first step (its peak is then known), on a model whose blocks free their gathered
    weights after forward. Returns the line to log, None where there is no such unit (one process)."""
    units = resharding_units(model)
    if not units:
        return None
    memory = device_memory(device)
    if memory is None:
        return "fsdp_reshard_after_forward auto: on CPU, the blocks free their gathered weights after forward"
    gathered = gathered_bytes(units, memory)
    peak, capacity = memory.peak(), memory.capacity()
    keep = all_ranks_fit(peak, gathered, capacity, group)
    if keep:
        keep_gathered_weights(units)
    verdict = "keep their gathered weights to the backward" if keep else "free their gathered weights after forward"
    return (f"fsdp_reshard_after_forward auto: the blocks {verdict} (this rank: the first step's peak "
            f"{peak / GIB:.1f} GiB + {gathered / GIB:.1f} GiB gathered, against {KEEP_FRACTION:.0%} of "
            f"{capacity / GIB:.1f} GiB)")
