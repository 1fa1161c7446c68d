"""Profiling a run as torchtitan users expect (`[profiling]`): a torch.profiler trace of one training step in
every `profile_freq` steps on every rank, and optionally a CUDA memory snapshot at the same steps.

Traces go to <dump_folder>/<save_traces_folder>/iteration_N/rank{R}_trace.json (open in Perfetto or
chrome://tracing); rank 0 also logs a table of the traced step's most expensive ops, a quick answer to "where does
a step's time go". Snapshots go to <dump_folder>/<save_memory_snapshot_folder>/iteration_N/rank{R}_memory_snapshot.pickle
(drag into https://pytorch.org/memory_viz). Steps are training steps, so a resumed run traces the same ones.
"""

from __future__ import annotations

import logging
import os
import pickle
import warnings

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile

from .config import JobConfig

logger = logging.getLogger(__name__)


class StepProfiler:
    """Call `step(n)` after each training step n, and `close()` at the end (or use it as a context manager)."""

    def __init__(self, cfg: JobConfig, rank: int, device: torch.device, start_step: int):
        p = cfg.profiling
        self.freq, self.rank, self.start, self.step_done = p.profile_freq, rank, start_step, start_step
        self.trace_dir = os.path.join(cfg.job.dump_folder, p.save_traces_folder)
        self.snapshot_dir = os.path.join(cfg.job.dump_folder, p.save_memory_snapshot_folder)
        self.profiler, self.on_cuda = None, device.type == "cuda"
        if p.enable_profiling:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            # Each traced step is a cycle of its own, saved when it ends: that events do not carry over is the point.
            warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle")
            self.profiler = profile(activities=activities, schedule=self._action, on_trace_ready=self._save_trace)
            self.profiler.start()
        self.snapshots = p.enable_memory_snapshot and device.type == "cuda"
        if p.enable_memory_snapshot and not self.snapshots:
            logger.warning("profiling.enable_memory_snapshot needs CUDA (the allocator history is a CUDA feature); "
                           "no snapshots on %s", device.type)
        if self.snapshots:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def step(self, step: int) -> None:
        self.step_done = step
        if self.profiler is not None:
            self.profiler.step()  # ends training step `step` for the profiler's schedule (saves if it was traced)
        if self.snapshots and step % self.freq == 0:
            folder = self._folder(self.snapshot_dir, step)
            with open(os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle"), "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)

    def __enter__(self) -> "StepProfiler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
        if self.snapshots:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshots = False

    def _action(self, k: int) -> ProfilerAction:
        """The profiler's k-th step (from 0) is training step start + k + 1: warm up on the step before each
        multiple of freq, trace the multiple."""
        step = self.start + k + 1
        if step % self.freq == 0:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.WARMUP if (step + 1) % self.freq == 0 else ProfilerAction.NONE

    def _folder(self, root: str, step: int) -> str:
        folder = os.path.join(root, f"iteration_{step}")
        os.makedirs(folder, exist_ok=True)
        return folder

    def _save_trace(self, prof) -> None:
        path = os.path.join(self._folder(self.trace_dir, self.step_done), f"rank{self.rank}_trace.json")
        prof.export_chrome_trace(path)
        if self.rank == 0:
            sort_by = "self_device_time_total" if self.on_cuda else "self_cpu_time_total"
            table = prof.key_averages().table(sort_by=sort_by, row_limit=15)
            logger.info("profiled step %d (trace %s); its top ops:\n%s", self.step_done, path, table)
