"""What happened inside each training step: which steps compiled graphs or kernels, collected garbage or grew the
CUDA allocator, and how long each took. Finds the cause of a step that runs far slower than its neighbours.

    python benchmarks/tools/step_stalls.py benchmarks/train_throughput.py --layers 8 --experts 32 \
        -- --training.local_batch_size 2 --compile.enable true --activation_checkpoint.mode none

Runs the given script (any script that trains through harness.trainer.Trainer, in this checkout or another) with
counters around each `Trainer.train_step` call, and prints one line per step: the wall time from the start of this
step's call to the start of the next (the host's time; under compile the host runs ahead of the GPU, so a stall
shows in the step whose host work waited), the dynamo graphs compiled in it (and the guard that failed, for a
recompile), the Triton kernels compiled in it (by name, with their integer arguments' specialisation: a new value
that is 1 or a multiple of 16 compiles a new variant), Python's garbage collections and their time, and the CUDA
allocator's device allocations and retries (a retry frees cached blocks and synchronises).
"""

from __future__ import annotations

import collections
import gc
import logging
import runpy
import sys
import time
from pathlib import Path

import torch


class StepCounters:
    """Events counted since the current step began."""

    def __init__(self):
        self.step, self.started = 0, None
        self.triton: list[str] = []
        self.recompiles: list[str] = []
        self.gc_runs, self.gc_seconds, self._gc_start = 0, 0.0, 0.0
        self.alloc0 = self.retries0 = self.graphs0 = 0

    def gc_callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_runs += 1
            self.gc_seconds += time.perf_counter() - self._gc_start

    def triton_compiled(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled) -> None:
        name, _, args = repr.partition("](")
        ints = [a for a in args.rstrip(")").split(", ") if ": i" in a or ": u" in a]  # the integer arguments' kinds
        self.triton.append(f"{name.split('[')[0]}({', '.join(ints)[:200]})")

    def _allocator(self) -> tuple[int, int]:
        if not torch.cuda.is_available():
            return 0, 0
        stats = torch.cuda.memory_stats()
        return stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)

    def begin(self, step: int) -> None:
        """Close the previous step's line, open this one's."""
        now = time.perf_counter()
        if self.started is not None:
            self.report(now)
        self.step, self.started = step, now
        self.triton, self.recompiles, self.gc_runs, self.gc_seconds = [], [], 0, 0.0
        self.alloc0, self.retries0 = self._allocator()
        self.graphs0 = _graphs()

    def report(self, now: float) -> None:
        allocs, retries = self._allocator()
        names = collections.Counter(name.split("(")[0] for name in self.triton)
        triton = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in names.most_common(8))
        print(f"stalls: step {self.step:3d} {now - self.started:7.3f} s  dynamo graphs {_graphs() - self.graphs0}  "
              f"triton compiles {len(self.triton)}{' (' + triton + ')' if triton else ''}  gc {self.gc_runs} "
              f"({self.gc_seconds * 1e3:.0f} ms)  cudaMalloc {allocs - self.alloc0}  alloc retries "
              f"{retries - self.retries0}", flush=True)
        for line in self.recompiles[:4]:
            print(f"stalls:     {line}", flush=True)
        for line in self.triton[:6]:
            print(f"stalls:     triton {line}", flush=True)


def _graphs() -> int:
    """Graphs dynamo has captured so far in this process (first compiles and recompiles)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class _Recompiles(logging.Handler):
    """Dynamo's recompile reasons (TORCH_LOGS=recompiles's records) into the step's counters."""

    def __init__(self, counters: StepCounters):
        super().__init__()
        self.counters = counters

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Recompiling function" in message or "guard failure" in message or message.lstrip().startswith("- "):
            self.counters.recompiles.append(message.strip().splitlines()[-1][:200])


def install(counters: StepCounters) -> None:
    from harness.trainer import Trainer

    gc.callbacks.append(counters.gc_callback)
    try:
        import triton

        triton.knobs.runtime.jit_post_compile_hook = counters.triton_compiled
    except (ImportError, AttributeError):
        print("stalls: no Triton compile hook (Triton missing or older than 3.4)", flush=True)
    torch._logging.set_logs(recompiles=True)
    logging.getLogger("torch._dynamo").addHandler(_Recompiles(counters))

    plain_step = Trainer.train_step

    def counted_step(self, microbatches):
        counters.begin(self.step)
        return plain_step(self, microbatches)

    Trainer.train_step = counted_step


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    script = Path(sys.argv[1]).resolve()
    # The script's own checkout's trainer (another checkout's script counts the code it runs, not this one's).
    repo = next((d for d in script.parents if (d / "harness").is_dir()), Path(__file__).resolve().parents[2])
    sys.path[:0] = [str(script.parent), str(repo)]
    counters = StepCounters()
    install(counters)
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as end:
        code = end.code
    else:
        code = 0
    if counters.started is not None:
        counters.report(time.perf_counter())  # the last step, to the end of the run
    return code if isinstance(code, int) else 1


if __name__ == "__main__":
    sys.exit(main())
