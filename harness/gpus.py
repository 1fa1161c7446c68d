"""The GPUs this process may use and the processes a launch starts on this node, known without importing torch (the
launcher decides before any worker starts, and the config check judges a run's memory by them)."""

from __future__ import annotations

import os
from pathlib import Path


def visible_gpus() -> int:
    """GPUs this process may use, counted without importing torch (CUDA_VISIBLE_DEVICES, else the driver's list)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    driver = Path("/proc/driver/nvidia/gpus")
    return len(list(driver.iterdir())) if driver.is_dir() else 0


def processes_per_node() -> int:
    """The launch's processes on this node: a worker's LOCAL_WORLD_SIZE (torchrun's), else NGPU, else one per
    visible GPU, else 1."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("NGPU") or visible_gpus() or 1)
