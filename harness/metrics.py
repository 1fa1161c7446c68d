"""Training metrics: MFU (the model's FLOPs per token, models/qwen35_moe/flops.py, against the device's dense bf16
peak; on CPU MFU is not defined and is logged as null), the mean attended keys of a step's rows, memory, and the log
sinks (console, metrics.jsonl, TensorBoard, and Weights & Biases where asked).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

import torch

from .atomic_file import write_whole
from .run_outputs import OutputError

logger = logging.getLogger(__name__)

# Dense bf16 tensor-core peak FLOP/s, by device-name substring (most specific first).
_PEAK_BF16 = [("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("H800", 989e12), ("GH200", 989e12),
              ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("A10G", 70e12)]


def mean_attended_keys(position_ids: torch.Tensor) -> float:
    """Mean keys per query of causal attention within documents: a token at position p of its document attends
    to p + 1 keys. `position_ids`: the rows' host positions (restarting at 0 at each document)."""
    return (position_ids.double() + 1).mean().item()


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in _PEAK_BF16:
        if key in name:
            return flops
    logger.warning("unknown GPU %r: MFU is not reported", name)
    return None


class DeviceClock:
    """Moments on the device's own timeline: a CUDA event (recorded after the work queued so far, timed when the GPU
    reaches it), or on CPU, where work has run when it returns, the host's clock. The time between two moments is
    what the device spent between them, whenever the host reads it: a step's rate does not depend on when its
    metrics are read."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        """Seconds from `start` to `end` (moments of `now`); waits for `end` to be reached."""
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000


def max_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 1024**2


def max_reserved_gib(device: torch.device) -> float | None:
    """Peak memory the CUDA allocator held from the device (allocated, plus what fragmentation left free in its
    segments): what must fit the card. None on CPU."""
    return torch.cuda.max_memory_reserved(device) / 1024**3 if device.type == "cuda" else None


def _split_records(data: bytes, step: int) -> tuple[bytes, list[bytes]]:
    """(the lines of a metrics.jsonl whose step is at most `step`, the damaged lines): a line is damaged when it is
    not UTF-8, not a JSON object, or holds no integer step (a line cut by a kill, a byte flipped on disk, an edit)."""
    kept, damaged = [], []
    for line in data.splitlines(keepends=True):
        try:
            record = json.loads(line.decode("utf-8"))
            record_step = record["step"]
            if not isinstance(record_step, int) or isinstance(record_step, bool):
                raise TypeError(record_step)
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError, RecursionError):
            if line.strip():
                damaged.append(line if line.endswith(b"\n") else line + b"\n")
            continue
        if record_step <= step:
            kept.append(line if line.endswith(b"\n") else line + b"\n")
    return b"".join(kept), damaged


def _keep_records_up_to(path: Path, step: int) -> None:
    """Drops the lines of `path` beyond `step` by writing the kept ones to a temporary file renamed over it: at every
    moment the file holds either all its lines or the kept ones, never fewer (truncating it in place and writing
    them back would leave it empty, or half written, to a kill in between). Damaged lines are moved, not dropped:
    into metrics-damaged-<UTC time>.jsonl beside it (written first), with one log line counting them."""
    if path.is_symlink():  # planted by someone else: never read or written through
        raise OSError(f"{path} is a symbolic link, which this run never writes; remove it")
    if not path.is_file():
        return
    data = path.read_bytes()
    kept, damaged = _split_records(data, step)
    if kept == data:
        return
    if damaged:
        stamp, n = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), 1
        aside = path.with_name(f"metrics-damaged-{stamp}.jsonl")
        while aside.exists():  # two launches within a second: never over the earlier one's
            aside, n = path.with_name(f"metrics-damaged-{stamp}-{n}.jsonl"), n + 1
        write_whole(aside, b"".join(damaged), durable=True)
        logger.warning("metrics: %d damaged line(s) of %s (not UTF-8, not JSON, or without a step) moved to %s",
                       len(damaged), path, aside)
    write_whole(path, kept, durable=True)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class MetricsLogger:
    """Rank 0 writes a console line, one JSON object per logged step to metrics.jsonl, and TensorBoard scalars.

    The dump folder's metrics.jsonl is this run's line's (harness/run_outputs.py moved another line's aside before):
    a fresh run finds none; a run resumed at step k (`resume_step`) keeps its records up to step k and appends.
    TensorBoard events of each line go to their own sub-folder, <tb_folder>/<run id> (`run_id`); a resumed run
    reopens it and drops its events after step k (those of the steps after the checkpoint, which the resumed run
    computes again). Each line is written through to the file as it is logged, so a kill loses no logged step; the
    run lock (harness/run_lock.py) makes this run the file's only writer. A write the file system refuses is an
    OutputError (exit 2, one line). With `wandb_config` (the run's resolved config, where metrics.enable_wandb is on)
    the same values also go to a Weights & Biases run (harness/wandb_logger.py).
    """

    def __init__(self, dump_folder: str | Path, total_steps: int, enable_tensorboard: bool, tb_folder: str,
                 run_id: str, enabled: bool = True, job_name: str = "", resume_step: int | None = None,
                 wandb_config: dict | None = None):
        self.enabled = enabled
        self.prefix = f"[{job_name}] " if job_name else ""
        self.total_steps = total_steps
        self.start = time.perf_counter()
        self.first_step: int | None = None
        self.writer = None
        self.jsonl = None
        self.tb_dir: Path | None = None
        self.wandb = None
        if not enabled:
            return
        folder = Path(dump_folder)
        self.path = folder / "metrics.jsonl"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            _keep_records_up_to(self.path, resume_step or 0)  # a fresh run (step 0) keeps no line
            # appended to, never through a link planted at its name
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
            self.jsonl = os.fdopen(fd, "a")
        except OSError as e:
            raise self._refused(e) from None
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb_dir = folder / tb_folder / run_id
            purge = resume_step + 1 if resume_step is not None else None
            self.writer = SummaryWriter(log_dir=str(self.tb_dir), purge_step=purge)
        if wandb_config is not None:  # wandb is imported there, only for a run that asks for it
            from .wandb_logger import WandbLogger

            self.wandb = WandbLogger(job_name, run_id, folder, wandb_config)

    def _refused(self, e: OSError) -> OutputError:
        return OutputError(f"cannot write {self.path}: {e.strerror or e}; free space (or fix the file system), then "
                           "relaunch: it resumes from the last checkpoint")

    def _write(self, record: dict) -> None:
        try:
            self.jsonl.write(json.dumps(record) + "\n")
            self.jsonl.flush()
        except OSError as e:
            raise self._refused(e) from None

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        if not self.enabled:
            return
        if self.first_step is None:
            self.first_step, self.start = step, time.perf_counter()
        self._write({"step": step, **metrics})
        if self.writer is not None:
            for key, value in metrics.items():
                if value is not None:
                    self.writer.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(step, metrics)
        done = step - self.first_step
        elapsed = time.perf_counter() - self.start
        eta = elapsed / done * (self.total_steps - step) if done else float("nan")
        mfu = metrics.get("mfu")
        loads = "".join(f"{label} {metrics[key]:.2f}  " for key, label in (("expert_load", "load"),
                                                                          ("ep_rank_load", "ep_load"))
                        if key in metrics)
        mtp = f"mtp_loss {metrics['mtp_loss']:.4f}  " if "mtp_loss" in metrics else ""
        line = (
            f"{self.prefix}step {step:>{len(str(self.total_steps))}}/{self.total_steps}  loss {metrics['loss']:.4f}  {mtp}"
            f"grad_norm {metrics['grad_norm']:.3f}  lr {metrics['lr']:.2e}  {loads}"
            f"tok/s {metrics['tokens_per_sec']:,.0f}  mfu {'n/a' if mfu is None else f'{mfu:.1%}'}  "
            f"mem {metrics['max_memory_gib']:.2f}GiB  eta {_duration(eta) if done else '?'}"
        )
        print(line, file=sys.stdout, flush=True)

    def log_validation(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._write({"step": step, **metrics})
        if self.writer is not None:
            for key in ("val_loss", "val_mtp_loss", "val_mtp_accept"):
                if key in metrics:
                    self.writer.add_scalar(key, metrics[key], step)
        if self.wandb is not None:
            self.wandb.log(step, metrics)
        mtp = (f", MTP loss {metrics['val_mtp_loss']:.4f}, first draft accepted {metrics['val_mtp_accept']:.1%}"
               if "val_mtp_loss" in metrics else "")
        print(f"{self.prefix}validation at step {step}: loss {metrics['val_loss']:.4f}{mtp} over "
              f"{metrics['val_tokens']:,} tokens", file=sys.stdout, flush=True)

    def close(self) -> None:
        if self.jsonl is not None:
            try:
                self.jsonl.close()
            except OSError:  # its last write already failed, and said so
                pass
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.close()
