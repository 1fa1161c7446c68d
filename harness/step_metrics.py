"""A training step's values, read from the device late, and the metrics record logged of them.

Reading a value that lives on the device is a host sync. The loop reads a step's values only when they are logged
(every `metrics.log_freq` steps) or before something that must never see a diverged step's weights (validation, a
save). `StepValues` holds one step's values, copied to the host as soon as its kernels have run; `StepLog` keeps
the steps run since the last read, reads them in one sync (raising at the first non-finite one) and logs the due
steps' records: the losses, the tokens per second of the device's own timeline, MFU and peak memory.

On CUDA a due step is logged one step late, once the next step is queued: reading it then does not drain the GPU's
queue, which with log_freq 1 left the GPU idle at every step's start while the host queued the next forward. The
first and last steps, and any step that validates, saves or stops, are read at once, and so is every step where
the device does not run ahead of the host (CPU: a step has run when it returns, so a late read would count the next
step's time in this step's tokens/s).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .metrics import DeviceClock, MetricsLogger, max_memory_gib, max_reserved_gib
from .objective import StepLosses, routing_loads

NAMES = ("loss", "aux_loss", "mtp_loss", "grad_norm", "expert_load", "ep_rank_load")


def reported_names(mtp: bool, ep: int) -> tuple[str, ...]:
    """The values a step reports: the MTP loss with a trained MTP layer, the EP rank load under EP."""
    return ("loss", "aux_loss", "grad_norm", "expert_load", *(("mtp_loss",) if mtp else ()),
            *(("ep_rank_load",) if ep > 1 else ()))


class TrainingDivergedError(RuntimeError):
    """The loss became NaN or infinite; nothing was saved for that step."""


class StepValues:
    """Step `step`'s values (`NAMES`: its losses, gradient norm and routing loads, packed into one tensor on the
    device), copied to the host as soon as the step's kernels have run: reading them waits for that step only. (Read
    from the device, they would wait for every kernel queued after them too, the next step's included.) `ended`: the
    moment the step ended on the device (metrics.DeviceClock). `reported`: the names a read returns."""

    def __init__(self, step: int, losses: StepLosses, grad_norm: torch.Tensor, ep: int, clock: DeviceClock,
                 reported: tuple[str, ...]):
        self.step, self.reported = step, reported
        dtype = losses.loss.dtype
        values = torch.cat((torch.stack((losses.loss, losses.aux_loss, losses.mtp_loss, grad_norm.to(dtype))),
                            routing_loads(losses.routing_counts, ep).to(dtype)))
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
        else:
            self.host = values
        self.ended = clock.now()

    def read(self) -> dict[str, float]:
        """The values by name; TrainingDivergedError if the loss, MTP loss or gradient norm is not finite."""
        if isinstance(self.ended, torch.cuda.Event):
            self.ended.synchronize()
        values = dict(zip(NAMES, self.host.tolist()))
        if not all(map(math.isfinite, (values["loss"], values["mtp_loss"], values["grad_norm"]))):
            mtp = f", MTP loss {values['mtp_loss']}" if "mtp_loss" in self.reported else ""
            raise TrainingDivergedError(
                f"step {self.step}: loss is {values['loss']}{mtp}, grad norm {values['grad_norm']}; stopping without "
                "saving this step. Lower optimizer.lr or check the data.")
        return {name: values[name] for name in self.reported}


class StepLog:
    """The steps run since they were last read and logged (see the module docstring)."""

    def __init__(self, metrics: MetricsLogger, clock: DeviceClock, device: torch.device, tokens_per_step: int,
                 flops_per_token: Callable[[float], float], peak_flops: float | None, mtp: bool = False, ep: int = 1):
        """`tokens_per_step`: this device's tokens of one step; `flops_per_token(mean attended keys)`: the training
        FLOPs of one token (models/qwen35_moe/flops.py); `peak_flops`: the device's (None: no MFU); `mtp`: an MTP
        layer trains; `ep`: the expert-parallel degree."""
        self.metrics, self.clock, self.device = metrics, clock, device
        self.ep, self.reported = ep, reported_names(mtp, ep)
        self.tokens_per_step, self.flops_per_token, self.peak_flops = tokens_per_step, flops_per_token, peak_flops
        self.unread: list[StepValues] = []
        self.window: list[tuple[int, float, float, object, object]] = []  # not yet logged: step, keys, lr, moments
        self.began = clock.now()
        self.deferred: int | None = None  # a due step, logged once the next one is queued
        self.last: dict[str, float] = {}

    @property
    def read_late(self) -> bool:
        """Whether a due step waits for the next one to be queued: only a device that runs behind the host gains."""
        return self.device.type == "cuda"

    def values(self, step: int, losses: StepLosses, grad_norm: torch.Tensor) -> StepValues:
        """Step `step`'s values, unread (`StepValues`), from its losses and gradient norm."""
        return StepValues(step, losses, grad_norm, self.ep, self.clock, self.reported)

    def ran(self, values: StepValues, attended_keys: float, lr: float) -> None:
        """A step is queued: its values, the mean keys a query attended to in its rows, and its learning rate."""
        self.unread.append(values)
        self.window.append((values.step, attended_keys, lr, self.began, values.ended))
        self.began = values.ended

    def paused(self) -> None:
        """Something other than training ran since the last step (validation, a save): not counted in tokens/s."""
        self.began = self.clock.now()

    def read(self, through: int | None = None) -> dict[str, float]:
        """Read the steps run since the last read, up to step `through` (all by default), in one host sync; raises
        TrainingDivergedError at the first non-finite one. Returns the last read step's values."""
        ready = [v for v in self.unread if through is None or v.step <= through]
        for values in ready:
            self.last = values.read()
        self.unread = self.unread[len(ready):]
        return self.last

    def due(self, step: int, at_once: bool) -> None:
        """Step `step`'s record is due: logged now if `at_once` or where the device does not run ahead, else once
        the next step is queued (`log_deferred`)."""
        if at_once or not self.read_late:
            self.log(step)
        else:
            self.deferred = step

    def log_deferred(self) -> None:
        """Log the step deferred by `due`, once the step after it is queued."""
        if self.deferred is not None:
            self.log(self.deferred)
            self.deferred = None

    def log(self, step: int) -> None:
        last = self.read(through=step)  # the host waits for the device to finish `step` here
        done = [w for w in self.window if w[0] <= step]
        self.window = [w for w in self.window if w[0] > step]
        # The device's time for these steps, however late the host reads them (metrics.DeviceClock)
        seconds = sum(self.clock.seconds(began, ended) for *_, began, ended in done)
        tps = len(done) * self.tokens_per_step / seconds  # per device, as torchtitan reports it
        # MFU of this rank's rows (CP ranks share theirs), attention counted by their real documents
        flops = self.flops_per_token(sum(w[1] for w in done) / len(done))
        mfu = None if self.peak_flops is None else tps * flops / self.peak_flops
        reserved = max_reserved_gib(self.device)
        self.metrics.log(step, {**last, "lr": done[-1][2], "tokens_per_sec": tps, "mfu": mfu,
                                "max_memory_gib": max_memory_gib(self.device),
                                **({} if reserved is None else {"max_reserved_gib": reserved})})
