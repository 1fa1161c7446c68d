"""DCP checkpoints of a run: saved every `checkpoint.interval` steps and at the last one, the latest
`keep_latest_k` kept, and the newest one that verifies resumed at the next launch (docs/design.md, "Checkpoints").

Layout: <dump_folder>/<checkpoint.folder>/step-N/ holds torch.distributed.checkpoint's files, hf/ (config.json and
the tokenizer files, so `python -m harness.convert step-N out/` writes a complete HF folder) and then, last, COMPLETE,
written by rank 0 once every rank's files are written: the step, the world size and each file's size and digest
(harness/checkpoint/integrity.py; every rank digests its own files, rank 0 gathers them). A folder without COMPLETE (a
save killed midway, or one the file system refused) is never resumed and is deleted by the next save.

Which step folder a launch resumes, and what is set aside: harness/checkpoint/step_folders.py. Its failures and the
ranks' common verdict: errors.py; the train and rank states as weights_only bytes: plain_state.py.

What a checkpoint holds (DCP keys):
  model.<fqn>          the model's state dict: DTensor shards under FSDP, so any world size / mesh loads it
  optimizer.<fqn>...   get_optimizer_state_dict (keyed by parameter name: reshardable too)
  train                step, LR schedule, data-loader position (global: the same on every rank), the model's
                       config, world size, the line's id (`run_id`: harness/run_outputs.py), the run's config (`run_config`)
  rank<r>              per rank: RNG states (python, torch CPU, CUDA) and, for streamed datasets, that rank's
                       loader; restored only at the same world size (rows of local datasets do not depend on it)
`train` and `rank<r>` hold tensors and plain values only (dicts, lists, tuples, numbers, strings), read back with
torch.load(weights_only=True): no code of the checkpoint's runs there. DCP's own .metadata is still a pickle that
torch unpickles whole, so a checkpoint from someone else is code: load only your own.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from models.qwen35_moe.hooks import canonical_name

from ..config.resume import data_changes
from ..data.errors import DataError
from ..lora.base import lora_problem
from .errors import CheckpointError, agreed, first_cause, one_line, rank_world
from .integrity import ALGORITHM, COMPLETE, digest_files, hash_threads, rank_0_files, rank_data_files, write_complete
from .plain_state import from_bytes, to_bytes
from .step_folders import gib, is_complete, set_aside, size_of, step_dirs, step_folders

logger = logging.getLogger(__name__)
# DCP says this on every save / load of a single-process run; that is what no_dist asks for.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

# torch's C++ writer's words for a write the file system refused, and the free space below which that is a full disk
_WRITER_FAILURES = ("PytorchStreamWriter failed", "file write failed", "unexpected pos")
_FULL_BYTES = 16 * 2**20
_RECORD_BYTES = 1536  # what DCP's torch.save of one tensor adds to its bytes (state_bytes)


def read_metadata(checkpoint: str | Path) -> Metadata:
    """A DCP checkpoint's metadata (its .metadata file: every key's shape and dtype, no tensor data)."""
    try:
        return FileSystemReader(str(checkpoint)).read_metadata()
    except Exception as e:  # a folder without (or with an unreadable) .metadata
        raise CheckpointError(f"{checkpoint} is not a readable DCP checkpoint: {e}") from None


def model_tensors(metadata: Metadata) -> dict[str, TensorStorageMetadata]:
    """{native key: its metadata (global size, dtype)} of the model weights a DCP checkpoint holds."""
    return {key[len("model."):]: md for key, md in metadata.state_dict_metadata.items()
            if key.startswith("model.") and hasattr(md, "size")}


def _newly_trained_mtp_params(metadata: Metadata, optimizer_state: dict) -> list[str]:
    """The MTP parameters this run trains whose optimizer state the checkpoint lacks (it was saved with them frozen,
    `training.mtp_loss_coef` 0), removed from `optimizer_state` (get_optimizer_state_dict's) so that the load skips
    them: they then start with no state, as at a first step. Any other parameter without saved state is left in,
    for the load to name."""
    saved = set()
    for key in metadata.state_dict_metadata:
        if key.startswith("optimizer.state."):
            saved.add(key[len("optimizer.state."):].rsplit(".", 1)[0])  # optimizer.state.<fqn>.<exp_avg ...>
    fresh = [fqn for fqn in optimizer_state["state"] if fqn not in saved and fqn.startswith("mtp.")]
    for fqn in fresh:
        del optimizer_state["state"][fqn]
    return fresh


class Checkpointer:
    """Saves and resumes the run's state. Every rank calls `save` / `resume` at the same points."""

    def __init__(self, folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler,
                 dataloader, *, keep_latest_k: int, async_mode: str, model_config: dict, hf_files=None,
                 run_config: dict | None = None, lora: dict | None = None):
        """`hf_files(folder)` writes config.json and the tokenizer beside each checkpoint. `run_config`: the run's
        config as a plain dict, saved in the train state and returned by `resume` (None from checkpoints without).
        `lora`: a LoRA run's adapters and base (harness/lora/base.py lora_record): its checkpoints then hold the trained
        parameters only, and resume only onto the same base."""
        self.folder = Path(folder)
        self.model, self.optimizer, self.lr_scheduler, self.dataloader = model, optimizer, lr_scheduler, dataloader
        self.keep_latest_k, self.model_config, self.hf_files = keep_latest_k, model_config, hf_files
        self.run_config, self.lora = run_config, lora
        # A LoRA run's frozen base is not saved (it is loaded again from where it came from)
        self.model_options = StateDictOptions(ignore_frozen_params=lora is not None)
        self.rank, self.world = rank_world()
        # An async save runs its collectives in a background thread: on a gloo group of its own, never on the
        # group the training step uses at the same time (interleaved collectives would deadlock or mix data).
        self.async_mode = async_mode
        self.async_group = dist.new_group(backend="gloo") if async_mode == "async" and dist.is_initialized() else None
        # Digests of an async save are taken in the background too, one thread: it competes with the training
        # step's host work, and nothing waits for it before the next save.
        self.hasher = ThreadPoolExecutor(1) if async_mode == "async" else None
        self.pending: tuple[Future, int, Path] | None = None  # an async save still writing, then hashing
        self.last_stall_s = 0.0  # how long the last save held training up

    # ---- what is saved ----

    def _train_state(self, step: int, run_id: str | None) -> dict:
        return {"step": step, "lr_scheduler": self.lr_scheduler.state_dict(),
                "dataloader": self.dataloader.state_dict() if self._global_loader_state() else None,
                "model_config": self.model_config, "world_size": self.world, "run_id": run_id,
                "run_config": self.run_config, "lora": self.lora}

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

    def _state_dict(self, step: int, run_id: str | None) -> dict:
        return {"model": get_model_state_dict(self.model, options=self.model_options), "optimizer": get_optimizer_state_dict(self.model, self.optimizer),
                "train": to_bytes(self._train_state(step, run_id)), f"rank{self.rank}": to_bytes(self._rank_state())}

    # ---- room on the disk ----

    def state_bytes(self) -> int:
        """About the bytes this rank's share of one checkpoint takes: its model tensors, and AdamW's two moments and
        step of each trained parameter (the moments in the parameter's dtype, as torch's and our optimizer keep them;
        counted from the parameters, since before the first step they do not exist yet), each tensor with the
        ~1.5 KiB of its own record that DCP's torch.save adds (measured: 1.6 KiB a stored item). 3% under the debug
        model's checkpoints, whose DCP metadata and small states come on top; nothing at 35B-A3B's size."""
        def local_bytes(t: torch.Tensor) -> int:
            t = t.to_local() if hasattr(t, "to_local") else t
            return t.numel() * t.element_size() + _RECORD_BYTES

        model = sum(local_bytes(t) for t in self.model.state_dict(keep_vars=True).values()
                    if self.lora is None or t.requires_grad)  # a LoRA run saves its trained parameters only
        return model + sum(2 * local_bytes(p) + 4 + _RECORD_BYTES for p in self.model.parameters() if p.requires_grad)

    def check_room(self, start_step: int, last_step: int, interval: int) -> None:
        """Before training: whether the checkpoints this launch will hold at once fit on the checkpoint folder's file
        system (keep_latest_k of them plus the one being written; all its saves with keep_latest_k 0). A line of
        warning when they do not; CheckpointError (exit 2, every rank) when not even one fits."""
        sizes = [self.state_bytes()]
        if dist.is_initialized():  # as objects: the default group may be NCCL's, which takes no host tensor
            sizes = [None] * self.world
            dist.all_gather_object(sizes, self.state_bytes(), group=self.async_group)
        size = sum(sizes)
        saves = len([s for s in range(start_step + 1, last_step + 1) if s % interval == 0 or s == last_step])
        error = None
        if self.rank == 0 and saves:
            held = step_folders(self.folder)
            needed = saves if self.keep_latest_k == 0 else max(1, min(saves, self.keep_latest_k + 1 - len(held)))
            partial = sum(size_of(p) for step, p in step_dirs(self.folder).items() if step not in held)  # deleted
            free = shutil.disk_usage(self.folder).free + partial                                     # by a save
            room = f"one checkpoint takes about {gib(size)} and {self.folder} has {gib(free)} free"
            if free < size:
                error = (f"not even one checkpoint fits: {room}. Free space, or choose another checkpoint.folder "
                         "(or job.dump_folder)")
            elif free < needed * size:
                kept = (f"the {needed} this run holds at once (checkpoint.keep_latest_k {self.keep_latest_k} and the "
                        "one being written)" if self.keep_latest_k else f"the {needed} this run saves "
                        "(checkpoint.keep_latest_k 0 keeps all)")
                logger.warning("checkpoint: %s: %s do not fit; a save that meets a full disk stops the run (exit 2, "
                               "the last intact checkpoint kept)", room, kept)
        error = agreed(error, self.async_group)
        if error is not None:
            raise CheckpointError(error, every_rank=True)

    # ---- saving ----

    def save(self, step: int, run_id: str | None = None) -> Path:
        """Save step `step` (waiting first for an async save still in flight). Returns its folder. CheckpointError,
        on every rank, if the file system refuses a write (a full disk): the folder is left without COMPLETE."""
        self.wait()
        path = self.folder / f"step-{step}"
        error = None
        if self.rank == 0:
            try:
                if path.is_symlink() or is_complete(path):  # put there since the resume: never deleted, nor followed
                    set_aside(self.folder, [path], f"in the way of this run's step-{step}")
                elif path.exists():  # an incomplete save of this step, from a run that died: start afresh
                    shutil.rmtree(path)
                path.mkdir(parents=True)
            except OSError as e:
                error = one_line(e)
        error = agreed(error, self.async_group)
        if error is not None:
            raise CheckpointError(self._save_error(step, path, error), every_rank=True)
        start = time.perf_counter()
        state = self._state_dict(step, run_id)
        if self.async_mode == "async":
            response = dcp.async_save(state, checkpoint_id=str(path), process_group=self.async_group,
                                      no_dist=not dist.is_initialized())
            written = getattr(response, "upload_completion", None) or response
            self.pending = (self.hasher.submit(self._own_digests, path, written, 1), step, path)
        else:
            try:
                dcp.save(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
                digests = self._own_digests(path, None, hash_threads())
            except (Exception, CheckpointException) as e:  # noqa: BLE001  (DCP's wrapper is a BaseException)
                digests = self._write_failure(e)
            self._finish(step, path, digests)
        self.last_stall_s = time.perf_counter() - start
        logger.info("checkpoint step-%d %s (training held up %.2f s)", step,
                    "being written in the background" if self.pending else f"saved to {path}", self.last_stall_s)
        return path

    def _own_digests(self, path: Path, written: Future | None, threads: int) -> dict[str, dict]:
        """Digests of the files this rank wrote (rank 0: also DCP's .metadata), once `written` (an async save's
        completion) is done."""
        if written is not None:
            written.result()
        names = rank_data_files(path, self.rank) + ([".metadata"] if self.rank == 0 else [])
        return digest_files(path, names, threads)

    def _write_failure(self, e: BaseException) -> str:
        """A refused write (on any rank: DCP passes its ranks' failures to all) as the error every rank reports;
        anything else is a fault of the code, raised as it is. A refused write is an OSError somewhere in the chain
        of causes, or torch's own writer's RuntimeError, which carries no OSError where the bytes went through
        its C++ stream (a CUDA tensor's copy is written that way); the file system is asked in that case."""
        cause = first_cause(e)
        while cause is not None and not isinstance(cause, OSError):
            # torch.save reports a write that failed under it as its own RuntimeError ("unexpected pos"), raised
            # while the OSError propagated
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            return one_line(cause)
        text = one_line(first_cause(e))
        if any(sign in text for sign in _WRITER_FAILURES):
            try:
                full = shutil.disk_usage(self.folder).free < _FULL_BYTES
            except OSError:
                full = False
            said = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", text)  # its C++ source line: no help here
            return f"{os.strerror(errno.ENOSPC) if full else 'the write failed'} (torch's writer: {said})"
        raise e

    def wait(self) -> None:
        """Complete an async save in flight (its files and their digests, then COMPLETE and pruning)."""
        if self.pending is None:
            return
        future, step, path = self.pending
        self.pending = None
        try:
            digests = future.result()
        except (Exception, CheckpointException) as e:  # noqa: BLE001
            digests = self._write_failure(e)
        self._finish(step, path, digests)

    def _finish(self, step: int, path: Path, digests: dict[str, dict] | str) -> None:
        """Every rank's digests (or its error) to rank 0, which writes hf/ and then COMPLETE, then prunes."""
        gathered = [digests] if not dist.is_initialized() else [None] * self.world
        if dist.is_initialized():
            dist.all_gather_object(gathered, digests, group=self.async_group)
        error = next((d for d in gathered if isinstance(d, str)), None)
        if error is None and self.rank == 0:
            try:
                if self.hf_files is not None:
                    (path / "hf").mkdir(exist_ok=True)
                    self.hf_files(path / "hf")
                files = {name: d for ranks in gathered for name, d in ranks.items()}
                files |= digest_files(path, [n for n in rank_0_files(path) if n not in files], hash_threads())
                write_complete(path, {"step": step, "world_size": self.world, "checksum": ALGORITHM, "files": files})
            except OSError as e:
                error = one_line(e)
        error = agreed(error, self.async_group)
        if error is not None:
            raise CheckpointError(self._save_error(step, path, error), every_rank=True)
        if self.rank == 0:
            self._prune(keep=step)
        self._barrier()

    def _save_error(self, step: int, path: Path, cause: str) -> str:
        intact = sorted(s for s in step_folders(self.folder) if s != step)
        last = (f"the last intact checkpoint is step-{intact[-1]} ({self.folder / f'step-{intact[-1]}'}), which a "
                "relaunch resumes" if intact else "there is no earlier checkpoint")
        return (f"cannot save checkpoint step-{step} to {path}: {cause}; {last}. Free space (or fix the file system) "
                "first")

    def _prune(self, keep: int) -> None:
        """Delete incomplete step folders (leftovers of killed saves) and complete ones beyond keep_latest_k; never
        `keep`, the checkpoint just saved, and each one's COMPLETE first, so that a kill midway leaves an incomplete
        folder, never a complete-looking partial one. Only step-N folders directly under the checkpoint folder."""
        complete = step_folders(self.folder)
        for step, path in step_dirs(self.folder).items():
            if step not in complete and step != keep:
                shutil.rmtree(path, ignore_errors=True)
        if self.keep_latest_k > 0:
            for step in sorted(complete)[:-self.keep_latest_k]:
                if step == keep:  # numbered below a step that was copied in, say: still the newest verified one
                    continue
                try:
                    (complete[step] / COMPLETE).unlink()
                except OSError as e:
                    logger.warning("not pruning %s: cannot remove its %s (%s)", complete[step], COMPLETE, e)
                    continue
                shutil.rmtree(complete[step], ignore_errors=True)

    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier(device_ids=[torch.cuda.current_device()] if dist.get_backend() == "nccl" else None)

    # ---- resuming ----

    def resume(self, step: int, restore_data: bool = True) -> dict:
        """Load step `step` into the model, optimizer, LR schedule, data loader and RNG; returns its train state (with
        `run_config`: None for a checkpoint saved without). Verification comes first: `verified_resume_step`.
        `restore_data` False (checkpoint.restart_data): the data loader keeps its start."""
        path = self.folder / f"step-{step}"
        metadata = read_metadata(path)
        train = from_bytes(self._load(path, {"train": b""})["train"], "train", path)
        problem = lora_problem(train.get("lora"), self.lora)
        if problem:
            raise CheckpointError(f"checkpoint {path} cannot resume this run: {problem}. Resume with the settings and "
                                  "base it was saved with, or start in another job.dump_folder")
        self._check_model_matches(path, metadata)
        if train.get("step") != step:  # COMPLETE agreed with the name (verification): its train state must too
            raise CheckpointError(f"checkpoint {path} holds the state of step {train.get('step')}, not {step}: a copy "
                                  "of another step's folder? Move it out of the checkpoint folder")
        train.setdefault("run_config", None)
        same_world = train["world_size"] == self.world
        state = {"model": get_model_state_dict(self.model, options=self.model_options),
                 "optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
        if same_world:
            state[f"rank{self.rank}"] = b""
        fresh = _newly_trained_mtp_params(metadata, state["optimizer"])
        groups = [list(group["params"]) for group in state["optimizer"]["param_groups"]]
        self._load(path, state)
        if fresh:  # the checkpoint's groups list the parameters it trained: this run's lists name the MTP's too
            for group, params in zip(state["optimizer"]["param_groups"], groups):
                group["params"] = params
            logger.info("checkpoint %s holds no optimizer state for the MTP layers (saved with them frozen): their "
                        "AdamW state starts afresh here", path)
        # Not strict under LoRA: the frozen base is not in it (_check_model_matches held the keys to the trained ones)
        set_model_state_dict(self.model, state["model"],
                             options=StateDictOptions(ignore_frozen_params=self.lora is not None,
                                                      strict=self.lora is None))
        # How the step runs (foreach or not) is this process's choice, for its device and layout; the checkpoint's
        # groups carry the flag of the run that saved it.
        foreach = [group.get("foreach") for group in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"],
                                 options=StateDictOptions(strict=not fresh))
        if fresh:  # no state at all, as before a first step (not the zeros of torch's lr-0 initialising step)
            params = {canonical_name(name): p for name, p in self.model.named_parameters()}
            for fqn in fresh:
                self.optimizer.state.pop(params[fqn], None)
        for group, flag in zip(self.optimizer.param_groups, foreach):
            group["foreach"] = flag
        self.lr_scheduler.load_state_dict(train["lr_scheduler"])
        rank_state = from_bytes(state[f"rank{self.rank}"], f"rank{self.rank}", path) if same_world else None
        if restore_data:
            self._restore_data_position(train, rank_state, path)
        else:
            logger.info("checkpoint.restart_data: the data is read from its start")
        if same_world:
            self._restore_rank_state(rank_state)
        elif train["dataloader"] is None and restore_data:
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
            others = [f"step-{s}" for s, p in sorted(step_folders(self.folder).items()) if p != path]
            hint = (f"; an earlier checkpoint may be intact: resume it with checkpoint.load_step (complete ones: "
                    f"{', '.join(others)})" if others else "")
            raise CheckpointError(f"cannot load checkpoint {path}: {one_line(first_cause(e))}{hint}") from e
        return state

    def _check_model_matches(self, path: Path, metadata: Metadata) -> None:
        saved = {key: tuple(md.size) for key, md in model_tensors(metadata).items()}
        ours = {canonical_name(k): tuple(v.shape)
                for k, v in get_model_state_dict(self.model, options=self.model_options).items()}
        missing, unexpected = sorted(ours.keys() - saved.keys()), sorted(saved.keys() - ours.keys())
        misshaped = [f"{k} {saved[k]} (model: {ours[k]})" for k in sorted(ours.keys() & saved.keys()) if saved[k] != ours[k]]
        problems = [f"{name}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''} ({len(keys)} in all)"
                    for name, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shapes", misshaped))
                    if keys]
        if problems:
            mtp_only = all(k.startswith("mtp.") for k in missing + unexpected) and not misshaped
            saved_depth = len({k.split(".")[2] for k in saved if k.startswith("mtp.layers.")})
            hint = (f" The difference is the MTP layers: resume with model.mtp_num_hidden_layers {saved_depth}."
                    if mtp_only else "")
            raise CheckpointError(f"checkpoint {path} was saved for another model - " + "; ".join(problems)
                                  + f".{hint} Resume with the model.flavor / model.hf_config it was saved with, or "
                                  "start in another job.dump_folder")

    def _restore_data_position(self, train: dict, rank_state: dict | None, path: Path) -> None:
        """The data loader's saved position (global, or this rank's for a stream), where it still means something:
        the same data, tokenizer and seq_len. Otherwise one CheckpointError naming every difference."""
        problems = data_changes(train["run_config"], self.run_config) if self.run_config is not None else []
        saved = train["dataloader"] if train["dataloader"] is not None else (rank_state or {}).get("dataloader")
        try:
            if saved is not None:
                self.dataloader.load_state_dict(saved)
        except DataError as e:  # the data's content differs (files added, another tokenizer), or its state does
            problems = problems or [str(e)]  # the config's differences, where there are some, say it plainer
        if problems:
            raise CheckpointError(
                f"checkpoint {path}: the data changed since it was saved ({'; '.join(problems)}), so its data "
                "position would point into other rows. Resume with the data it was saved with, or set "
                "checkpoint.restart_data = true to resume the weights, optimizer and schedule and read this data "
                "from its start")

    def _restore_rank_state(self, state: dict) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
