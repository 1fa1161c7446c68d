"""Stopping a run cleanly: SIGTERM (what SLURM and Kubernetes send before they kill a job) and Ctrl-C.

Either signal only sets a flag; the trainer checks it at every step boundary, all ranks agree (one all-reduce
of a CPU int over a gloo group, so no GPU sync; read one boundary late, so that no rank waits there for the
others), save a checkpoint when checkpointing is on, and stop with one line. A second Ctrl-C stops at once
(KeyboardInterrupt), without saving. Under torchrun the workers get torchrun's SIGTERM too, and torchrun kills
them 30 s later: one more step and a save on preemption must fit in that time (as in SLURM's default KillWait).
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

TERMINATED, INTERRUPTED = 1, 2  # reasons; the larger wins when ranks disagree


class StopRequested:
    def __init__(self):
        self.reason = 0
        self._vote = None  # the last boundary's all-reduce, still in flight: (work, its tensor)

    def install(self) -> None:
        """Catch SIGTERM and SIGINT (only possible in the main thread; elsewhere the defaults stay)."""
        if threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigterm(self, signum, frame) -> None:
        self.reason = max(self.reason, TERMINATED)

    def _on_sigint(self, signum, frame) -> None:
        if self.reason == INTERRUPTED:  # the second Ctrl-C: stop now
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.reason = INTERRUPTED

    def agreed(self, group: dist.ProcessGroup | None) -> int:
        """The reason to stop, the same on every rank (0: go on), one boundary late: each call starts the
        all-reduce of this rank's reason and returns the previous call's result. Waiting for its own all-reduce
        would hold every rank at every boundary until the slowest host arrived, so a host-bound step would pay the
        ranks' jitter (docs/performance.md, "Tried, not kept"). A rank may run up to one step ahead.
        `group`: a CPU (gloo) group, or None (one process: no vote, no delay)."""
        if group is None:
            return self.reason
        previous = self.settle()
        flag = torch.tensor([self.reason], dtype=torch.int32)
        self._vote = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True), flag)
        return previous

    def settle(self) -> int:
        """Wait for the vote in flight and return its result (0 without one). The trainer settles before it leaves
        its loop: every rank started that vote, and gloo work still pending when the process exits aborts it."""
        if self._vote is None:
            return 0
        work, flag = self._vote
        self._vote = None
        work.wait()
        return int(flag.item())


class TrainingStopped(Exception):
    """The run stopped early on a signal, after saving when checkpointing is on."""

    def __init__(self, step: int, reason: int, saved: str | None):
        self.step, self.reason, self.saved = step, reason, saved
        where = f"saved checkpoint {saved}; the next launch resumes there" if saved else "checkpointing is off: nothing saved"
        what = "stopped on SIGTERM" if reason == TERMINATED else "interrupted"
        super().__init__(f"{what} at step {step}; {where}")
