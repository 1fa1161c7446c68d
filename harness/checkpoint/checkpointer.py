"""DCP checkpoints of a run: saved every `checkpoint.interval` steps and at the last one, the latest
`keep_latest_k` kept, and the latest complete one resumed at the next launch.

Layout: <dump_folder>/<checkpoint.folder>/step-N/ holds torch.distributed.checkpoint's files and then, last,
COMPLETE (written by rank 0 once every rank's files and DCP's .metadata are written). A folder without
COMPLETE (a save killed midway) is never resumed and is deleted by the next save. Beside the DCP files, hf/ holds
config.json and the tokenizer files, so `python -m harness.convert step-N out/` writes a complete HF folder.

What a checkpoint holds (DCP keys):
  model.<fqn>          the model's state dict: DTensor shards under FSDP, so any world size / mesh loads it
  optimizer.<fqn>...   get_optimizer_state_dict (keyed by parameter name: reshardable too)
  train                step, LR schedule, data-loader position (global: the same on every rank), the model's
                       config, world size, the TensorBoard run folder
  rank<r>              per rank: RNG states (python, torch CPU, CUDA) and, for streamed datasets, that rank's
                       loader; restored only at the same world size (rows of local datasets do not depend on it)
Checkpoints are trusted input: loading one unpickles its metadata and the `train` / `rank<r>` entries.
"""

from __future__ import annotations

import io
import json
import logging
import random
import re
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from models.qwen35_moe.init import canonical_name

logger = logging.getLogger(__name__)
# DCP says this on every save / load of a single-process run; that is what no_dist asks for.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

COMPLETE = "COMPLETE"
_STEP_FOLDER = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed: missing, incomplete, corrupt or saved for another model."""


def step_folders(folder: str | Path) -> dict[int, Path]:
    """{step: folder} of the complete checkpoints under `folder`."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.iterdir():
        match = _STEP_FOLDER.match(path.name)
        if match and (path / COMPLETE).is_file():
            found[int(match.group(1))] = path
    return found


def latest_complete_step(folder: str | Path, load_step: int = -1) -> int | None:
    """The step to resume: `load_step` (which must be complete), else the latest complete one (None: none)."""
    complete = step_folders(folder)
    if load_step >= 0:
        if load_step not in complete:
            shown = ", ".join(f"step-{s}" for s in sorted(complete)) or "none"
            raise CheckpointError(f"checkpoint.load_step = {load_step}: {Path(folder) / f'step-{load_step}'} is not "
                                  f"a complete checkpoint (complete ones: {shown})")
        return load_step
    return max(complete) if complete else None


def model_tensor_shapes(checkpoint: str | Path) -> dict[str, tuple[int, ...]]:
    """{native key: global shape} of the model weights a DCP checkpoint holds (from its metadata only)."""
    try:
        metadata = FileSystemReader(str(checkpoint)).read_metadata()
    except Exception as e:  # a folder without (or with an unreadable) .metadata
        raise CheckpointError(f"{checkpoint} is not a readable DCP checkpoint: {e}") from None
    return {key[len("model."):]: tuple(md.size) for key, md in metadata.state_dict_metadata.items()
            if key.startswith("model.") and hasattr(md, "size")}


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _to_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)  # our own pickled RNG states: trusted input


class Checkpointer:
    """Saves and resumes the run's state. Every rank calls `save` / `resume` at the same points."""

    def __init__(self, folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler,
                 dataloader, *, keep_latest_k: int, async_mode: str, model_config: dict, hf_files=None):
        """`hf_files(folder)` writes config.json and the tokenizer beside each checkpoint."""
        self.folder = Path(folder)
        self.model, self.optimizer, self.lr_scheduler, self.dataloader = model, optimizer, lr_scheduler, dataloader
        self.keep_latest_k, self.model_config, self.hf_files = keep_latest_k, model_config, hf_files
        self.rank, self.world = _rank_world()
        # An async save runs its collectives in a background thread: on a gloo group of its own, never on the
        # group the training step uses at the same time (interleaved collectives would deadlock or mix data).
        self.async_mode = async_mode
        self.async_group = dist.new_group(backend="gloo") if async_mode == "async" and dist.is_initialized() else None
        self.pending: tuple[object, int, Path] | None = None  # an async save still writing
        self.last_stall_s = 0.0  # how long the last save held training up

    # ---- what is saved ----

    def _train_state(self, step: int, tb_run: str | None) -> dict:
        return {"step": step, "lr_scheduler": self.lr_scheduler.state_dict(),
                "dataloader": self.dataloader.state_dict() if self._global_loader_state() else None,
                "model_config": self.model_config, "world_size": self.world, "tb_run": tb_run}

    def _rank_state(self) -> dict:
        state = {"python": random.getstate(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        if not self._global_loader_state():
            state["dataloader"] = self.dataloader.state_dict()
        return state

    def _global_loader_state(self) -> bool:
        # Local datasets: a global row counter, identical on every rank. Streams: one state per rank.
        return "next_row" in self.dataloader.state_dict()

    def _state_dict(self, step: int, tb_run: str | None) -> dict:
        return {"model": get_model_state_dict(self.model), "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
                "train": _to_bytes(self._train_state(step, tb_run)), f"rank{self.rank}": _to_bytes(self._rank_state())}

    # ---- saving ----

    def save(self, step: int, tb_run: str | None = None) -> Path:
        """Save step `step` (waiting first for an async save still in flight). Returns its folder."""
        self.wait()
        path = self.folder / f"step-{step}"
        if self.rank == 0:
            if path.exists():  # an incomplete save of this step, from a run that died: start afresh
                shutil.rmtree(path)
            path.mkdir(parents=True)
        self._barrier()
        start = time.perf_counter()
        state = self._state_dict(step, tb_run)
        if self.async_mode == "async":
            response = dcp.async_save(state, checkpoint_id=str(path), process_group=self.async_group,
                                      no_dist=not dist.is_initialized())
            self.pending = (response, step, path)
        else:
            dcp.save(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
            self._finish(step, path)
        self.last_stall_s = time.perf_counter() - start
        logger.info("checkpoint step-%d %s (training held up %.2f s)", step,
                    "being written in the background" if self.pending else f"saved to {path}", self.last_stall_s)
        return path

    def wait(self) -> None:
        """Complete an async save in flight (its files, then COMPLETE and pruning)."""
        if self.pending is None:
            return
        response, step, path = self.pending
        self.pending = None
        (getattr(response, "upload_completion", None) or response).result()
        self._finish(step, path)

    def _finish(self, step: int, path: Path) -> None:
        self._barrier()  # every rank's files are written
        if self.rank == 0:
            if self.hf_files is not None:
                (path / "hf").mkdir(exist_ok=True)
                self.hf_files(path / "hf")
            (path / COMPLETE).write_text(json.dumps({"step": step, "world_size": self.world}) + "\n")
            self._prune(keep=step)
        self._barrier()

    def _prune(self, keep: int) -> None:
        """Delete incomplete step folders (leftovers of killed saves) and complete ones beyond keep_latest_k."""
        complete = step_folders(self.folder)
        for path in self.folder.iterdir():
            match = _STEP_FOLDER.match(path.name)
            if match and int(match.group(1)) not in complete and int(match.group(1)) != keep:
                shutil.rmtree(path, ignore_errors=True)
        if self.keep_latest_k > 0:
            for step in sorted(complete)[:-self.keep_latest_k]:
                shutil.rmtree(complete[step], ignore_errors=True)

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(device_ids=[torch.cuda.current_device()] if dist.get_backend() == "nccl" else None)

    # ---- resuming ----

    def resume(self, step: int) -> dict:
        """Load step `step` into the model, optimizer, LR schedule, data loader and RNG; returns its train state."""
        path = self.folder / f"step-{step}"
        self._check_model_matches(path)
        train = _from_bytes(self._load(path, {"train": b""})["train"])
        same_world = train["world_size"] == self.world
        state = {"model": get_model_state_dict(self.model),
                 "optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
        if same_world:
            state[f"rank{self.rank}"] = b""
        self._load(path, state)
        set_model_state_dict(self.model, state["model"])
        # How the step runs (foreach or not) is this process's choice, for its device and layout; the checkpoint's
        # groups carry the flag of the run that saved it.
        foreach = [group.get("foreach") for group in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        for group, flag in zip(self.optimizer.param_groups, foreach):
            group["foreach"] = flag
        self.lr_scheduler.load_state_dict(train["lr_scheduler"])
        if train["dataloader"] is not None:
            self.dataloader.load_state_dict(train["dataloader"])
        if same_world:
            self._restore_rank_state(_from_bytes(state[f"rank{self.rank}"]))
        elif train["dataloader"] is None:
            raise CheckpointError(f"{path} was saved by {train['world_size']} ranks with a streamed dataset, whose "
                                  f"position is per rank: resume it with {train['world_size']} ranks")
        else:
            logger.warning("checkpoint %s was saved by %d ranks, resumed by %d: weights, optimizer, schedule and data "
                           "position carry over; per-rank random states start afresh", path, train["world_size"],
                           self.world)
        logger.info("resumed from checkpoint %s (step %d)", path, train["step"])
        return train

    def _load(self, path: Path, state: dict) -> dict:
        try:
            dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        except (Exception, CheckpointException) as e:  # DCP's wrapper of per-rank failures is a BaseException
            cause = e.__cause__ or e
            if isinstance(e, CheckpointException) and getattr(e, "failures", None):
                cause = next(iter(e.failures.values()))[0]  # (exception, traceback) of the first failed rank
            first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
            raise CheckpointError(f"cannot load checkpoint {path}: {first}") from e
        return state

    def _check_model_matches(self, path: Path) -> None:
        saved = model_tensor_shapes(path)
        ours = {canonical_name(k): tuple(v.shape) for k, v in self.model.state_dict().items()}
        missing, unexpected = sorted(ours.keys() - saved.keys()), sorted(saved.keys() - ours.keys())
        misshaped = [f"{k} {saved[k]} (model: {ours[k]})" for k in sorted(ours.keys() & saved.keys()) if saved[k] != ours[k]]
        problems = [f"{name}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''} ({len(keys)} in all)"
                    for name, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shapes", misshaped))
                    if keys]
        if problems:
            raise CheckpointError(f"checkpoint {path} was saved for another model - " + "; ".join(problems)
                                  + ". Resume with the model.flavor / model.hf_config it was saved with, or "
                                  "start in another job.dump_folder")

    def _restore_rank_state(self, state: dict) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
        if "dataloader" in state:
            self.dataloader.load_state_dict(state["dataloader"])
