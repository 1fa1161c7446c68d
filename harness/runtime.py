"""Process runtime: the device, the default process group and the random seeds.

A process group exists on every GPU run, even a single one (the meshes and collectives then work as at scale;
a one-rank mesh gets no FSDP, parallel/parallelize.py), and on multi-process CPU runs; a single CPU process
needs none.
"""

from __future__ import annotations

import gc
import os
import random
from datetime import timedelta

import torch
import torch.distributed as dist


def pick_device() -> torch.device:
    """This process's GPU (LOCAL_RANK under torchrun), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def init_process_group(device: torch.device, world_size: int) -> None:
    """NCCL on GPU, gloo on CPU; a one-rank in-memory group for a single GPU process not started by torchrun."""
    if dist.is_initialized() or (device.type == "cpu" and world_size == 1):
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group(backend, timeout=timedelta(minutes=10))
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def set_seed(seed: int, deterministic: bool, device: torch.device) -> None:
    """Seed Python and torch (same seed on every rank: initial weights do not depend on the rank anyway)."""
    random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        if device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.backends.cudnn.benchmark = False


def cpu_process_group() -> dist.ProcessGroup | None:
    """A gloo group over all ranks (the default group when it is gloo), for small CPU-side agreements and DCP's
    async save; None without a process group."""
    if not dist.is_initialized():
        return None
    return dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")


class GarbageSchedule:
    """Python's cyclic garbage collector run every `freq` steps (its young generations), not whenever allocations
    trigger it: a collection pauses the host mid-step, and with the GPU fed by the host (compile) that stalls the
    GPU too. `freq` 0: Python's own schedule. A context manager: the collector is back on its own when it ends."""

    def __init__(self, freq: int):
        self.freq = freq

    def __enter__(self) -> "GarbageSchedule":
        if self.freq:
            gc.disable()
            gc.collect(1)
        return self

    def step(self, step: int) -> None:
        if self.freq and step % self.freq == 0:
            gc.collect(1)

    def __exit__(self, *exc) -> None:
        if self.freq:
            gc.enable()
