"""The one trainer: 1 CPU process or N GPUs on M nodes, same code.

The loop wires builders that each live in their own module: runtime (device, process group, seed), parallel
dims and mesh, tokenizer, model (model_setup), optimizer and LR schedule, data, loss, metrics, HF export.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

import torch

from models.qwen35_moe.flops import training_flops_per_token
from parallel.parallel_dims import ParallelDims
from parallel.reshard_policy import keep_if_it_fits

from .atomic_file import write_whole
from .batch import ModelInputs
from .checkpoint.checkpointer import Checkpointer
from .checkpoint.errors import CheckpointError, ExportRefused
from .checkpoint.hf_weights import ExportUnit, check_hf_export_folder, export_hf, with_tokenizer, write_hf_meta
from .checkpoint.step_folders import step_folders, verified_resume_step
from .config import ConfigError, JobConfig, to_toml, validate_parallelism, with_absolute_paths
from .config.resume import other_changes
from .config.run_requirements import model_args_of
from .data.tokenizer import build_tokenizer
from .data_setup import build_data_loader
from .lora.run import LoraRun
from .memory_check import device_memory_problem
from .metrics import DeviceClock, MetricsLogger, mean_attended_keys, peak_flops
from .model_setup import DTYPES, build_model, build_model_args, trains_mtp
from .objective import Objective, StepLosses
from .optim.lr_schedule import build_lr_scheduler
from .optim.optimizer import build_optimizer
from .optim.relaunch import apply_optimizer_settings
from .preemption import StopRequested, TrainingStopped
from .profiling import StepProfiler
from .run_folders import written_folders
from .run_lock import acquire_run_lock
from .run_outputs import EXPORT, OutputError, claim_outputs
from .runtime import GarbageSchedule, cpu_process_group, init_process_group, pick_device, set_seed
from .step_metrics import StepLog, StepValues, TrainingDivergedError
from .validation import Validator

logger = logging.getLogger(__name__)


__all__ = ["Trainer", "TrainingDivergedError"]


def attended_keys(batches: list[dict[str, torch.Tensor]]) -> float:
    """The mean number of keys a query attends to in these micro-batches' rows (for MFU)."""
    return sum(mean_attended_keys(b["position_ids"]) for b in batches) / len(batches)


class Trainer:
    def __init__(self, cfg: JobConfig):
        """The run of `cfg`, built in the order of the stages below; nothing is written before the run lock is held,
        nothing allocated before the memory check."""
        self.cfg = cfg
        self.rank = int(os.environ.get("RANK", "0"))
        self.layout = validate_parallelism(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # again for direct callers
        self.dims: ParallelDims = self.layout.dims
        self._start_runtime()
        ckpt = cfg.checkpoint
        self.checkpoint_folder = os.path.join(cfg.job.dump_folder, ckpt.folder)
        resume_step = verified_resume_step(self.checkpoint_folder, ckpt.load_step, self.cpu_group) \
            if ckpt.enable else None
        self._build_model(resumed=resume_step is not None)
        self._build_data()
        line = self._build_checkpointer(resume_step)
        # The dump folder's outputs become this line's: another line's are set aside (harness/run_outputs.py)
        self.run_id = self._claim_outputs(line, resumed=resume_step is not None)
        if cfg.checkpoint.export_hf_at_end:  # an export it may not write is refused now, not after the training
            for folder in self._export_folders(self.export_folder):
                check_hf_export_folder(folder)
        self._build_metrics(resumed=resume_step is not None)
        self.started = time.perf_counter()
        self.exporting = False  # whether the end-of-run export is being written (what_is_saved)
        self.export_unit: ExportUnit | None = None  # the export's folders being written, then published
        if self.rank == 0:
            self._save_config()

    def _start_runtime(self) -> None:
        """The device, the memory check, seeds, the process group and meshes, the run lock and the stop handler."""
        cfg = self.cfg
        self.device = pick_device()
        self._refuse_what_cannot_fit()  # before anything is allocated or written (harness/memory_check.py)
        set_seed(cfg.training.seed, cfg.training.deterministic, self.device)
        init_process_group(self.device, self.dims.world_size)
        self.meshes = self.dims.build_meshes(self.device.type)  # None: one process, no process group
        self.cpu_group = cpu_process_group()  # for the per-step stop check: no GPU sync
        # One run per dump folder (and checkpoint folder), locked before anything is written there (harness/run_lock.py)
        self.run_lock = acquire_run_lock(written_folders(cfg), self.rank, self.cpu_group)
        self.stop = StopRequested()

    def _build_model(self, resumed: bool) -> None:
        """The tokenizer, the model (with its LoRA part), the objective, the optimizer and the LR schedule."""
        cfg = self.cfg
        self.tokenizer = build_tokenizer(cfg.model.tokenizer_path)
        self.model_args = build_model_args(cfg, self.tokenizer.vocab_size)
        self.lora = LoraRun.from_config(cfg)  # None without LoRA (harness/lora/run.py)
        # Resuming: the checkpoint's weights replace the initial ones, so an HF checkpoint is not read at all (but
        # under LoRA, whose checkpoints hold the adapters only: the frozen base is read again).
        self.model = build_model(cfg, self.model_args, self.meshes, self.device, self.lora,
                                 load_hf=not resumed or self.lora is not None,
                                 grad_accum_steps=self.layout.grad_accum_steps)
        self.train_mtp = trains_mtp(cfg, self.model, self.lora)
        aux_loss_coef = (self.model_args.router_aux_loss_coef if cfg.training.aux_loss_coef < 0
                         else cfg.training.aux_loss_coef)
        self.objective = Objective(aux_loss_coef, cfg.training.mtp_loss_coef, self.dims.world_size,
                                   self.meshes is not None, self.device)
        self.optimizer = build_optimizer(self.model, cfg.optimizer, self.device)
        s = cfg.lr_scheduler
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.training.steps, s.warmup_steps, s.decay_ratio,
                                               s.decay_type, s.min_lr_factor)

    def _build_data(self) -> None:
        """How a micro-batch reaches the model, the training data and the validation set."""
        cfg = self.cfg
        self.model_inputs = ModelInputs(self.model, self.device, cfg.training.loss_chunk_tokens)  # harness/batch.py
        dp_rank = self.meshes.dp_rank if self.meshes is not None else 0  # CP ranks of one DP rank: same rows
        self.dataloader = build_data_loader(cfg, "training", self.tokenizer, dp_rank, self.dims.dp)
        self.validator = (Validator(cfg, self.tokenizer, dp_rank, self.dims.dp, self.device, self.model_inputs,
                                    mtp=self.model.mtp is not None)
                          if cfg.validation.enable else None)

    def _build_checkpointer(self, resume_step: int | None) -> str | None:
        """The checkpointer (checkpoint.enable) and, resuming, the loaded state with this launch's settings on top;
        returns the resumed checkpoint's line (None: a fresh start)."""
        cfg, ckpt = self.cfg, self.cfg.checkpoint
        self.step, line, self.checkpointer = 0, None, None
        if ckpt.enable:
            args_for_hf, hf_files = with_tokenizer(self.model_args, self.tokenizer)
            self.checkpointer = Checkpointer(
                self.checkpoint_folder, self.model, self.optimizer, self.lr_scheduler, self.dataloader,
                keep_latest_k=ckpt.keep_latest_k, async_mode=ckpt.async_mode,
                model_config=args_for_hf.to_hf_config(ckpt.export_dtype),
                hf_files=lambda folder: write_hf_meta(folder, args_for_hf, ckpt.export_dtype, hf_files),
                run_config=with_absolute_paths(cfg).to_dict(),
                lora=self.lora.record(self.model_args, self.device.type) if self.lora is not None else None)
        if resume_step is not None:
            train_state = self.checkpointer.resume(resume_step, restore_data=not ckpt.restart_data)
            self.step, line = train_state["step"], train_state.get("run_id") or train_state.get("tb_run")
            self._apply_relaunch_config(train_state.get("run_config"))
        self.first_step = self.step  # where this launch starts
        if self.checkpointer is not None:
            self.checkpointer.check_room(self.step, cfg.training.steps, ckpt.interval)
        return line

    def _build_metrics(self, resumed: bool) -> None:
        """The metrics sinks and the step log (harness/step_metrics.py): tokens, FLOPs and MFU of each step."""
        cfg, t = self.cfg, self.cfg.training
        self.metrics = MetricsLogger(cfg.job.dump_folder, t.steps, cfg.metrics.enable_tensorboard,
                                     cfg.metrics.save_tb_folder, self.run_id, enabled=self.rank == 0,
                                     job_name=cfg.job.name, resume_step=self.step if resumed else None,
                                     wandb_config=cfg.to_dict() if cfg.metrics.enable_wandb else None)
        self.clock = DeviceClock(self.device)
        tokens_per_step = t.local_batch_size * t.seq_len * self.layout.grad_accum_steps // self.dims.cp
        adapters = (self.lora.adapter_flops_params(self.model, self.model_args.num_experts_per_tok, self.train_mtp)
                    if self.lora is not None else None)
        self.steps = StepLog(self.metrics, self.clock, self.device, tokens_per_step,
                             lambda keys: training_flops_per_token(self.model_args, keys, self.train_mtp, adapters),
                             peak_flops(self.device), mtp=self.train_mtp, ep=self.dims.ep)

    def _refuse_what_cannot_fit(self) -> None:
        """ConfigError (exit 2, every rank alike) if the run cannot fit this process's device (its GPU's memory, or
        the host's), judged from the config before the model is built."""
        args, problems = model_args_of(self.cfg)
        problem = problems[0] if problems else device_memory_problem(self.cfg, args, self.dims.world_size,
                                                                     self.dims.cp, self.device)
        if problem is not None:
            raise ConfigError(problem)

    def _claim_outputs(self, line: str | None, resumed: bool) -> str:
        """Rank 0 sets the dump folder's outputs up for this run's line (harness/run_outputs.py); every rank learns
        the line's id, which every rank's checkpoint train state holds."""
        found = [line, None]
        if self.rank == 0:
            model = self.cfg.model.hf_config or f"model.flavor {self.cfg.model.flavor}"
            try:
                found = list(claim_outputs(self.cfg.job.dump_folder, line, resumed, model,
                                           keep_others=self.cfg.job.other_run_outputs == "keep",
                                           keep_newest=self.cfg.job.other_run_outputs_keep))
            except OutputError as e:
                found = [None, str(e)]
        if torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(found, src=0, group=self.cpu_group)
        if found[0] is None:
            raise OutputError(found[1], every_rank=True)
        if found[1] is not None and self.rank == 0:
            logger.warning(found[1])
        return found[0]

    def _apply_relaunch_config(self, saved_config: dict | None) -> None:
        """This launch's optimizer settings on top of the loaded state (harness/config/resume.py); a line for each
        value the relaunch changed."""
        changes = apply_optimizer_settings(self.optimizer, self.lr_scheduler, self.cfg)
        changes += other_changes(saved_config, self.cfg, self.step)
        if changes and self.rank == 0:
            logger.info("resumed with this launch's config; changed since the checkpoint:\n  %s", "\n  ".join(changes))

    def _save_config(self) -> None:
        """The resolved config, saved as <dump_folder>/config.toml (`--config` on it continues the run), and one line
        saying where (the ~100 lines of it are in the file, not on every launch's console).

        Without this launch's one-off resume choices: a relaunch from the file continues the run's line rather
        than rolling back to `checkpoint.load_step` again or restarting the data (`checkpoint.restart_data`)."""
        ckpt = dataclasses.replace(self.cfg.checkpoint, load_step=-1, restart_data=False)
        text = to_toml(dataclasses.replace(self.cfg, checkpoint=ckpt))
        path = os.path.join(self.cfg.job.dump_folder, "config.toml")
        try:
            write_whole(path, text)  # a kill mid-write leaves the previous file whole
        except OSError as e:
            raise OutputError(f"cannot write {path}: {e.strerror or e}; free space (or fix the file system) "
                              "first") from None
        logger.info("resolved config saved to %s (every value; `--help` with the same flags shows each with its "
                    "comment)", os.path.abspath(path))

    def train_step(self, microbatches: list[dict[str, torch.Tensor]]) -> StepValues:
        """One optimizer step over the global batch (this data-parallel rank's micro-batches of host rows). Returns its
        values unread (`.read()`: the global loss, balance loss, grad norm, routing loads; TrainingDivergedError if
        they are not finite): reading them is a host sync, which the loop makes only when it logs or saves."""
        return self.steps.values(self.step, *self._step(microbatches))

    def _step(self, microbatches: list[dict[str, torch.Tensor]]) -> tuple[StepLosses, torch.Tensor]:
        """One optimizer step; returns its losses and the gradient norm before clipping, on the device."""
        self.optimizer.zero_grad(set_to_none=True)
        inputs = [self.model_inputs(mb, mtp=self.train_mtp) for mb in microbatches]
        losses = self.objective.minimise(self.model, inputs)  # harness/objective.py
        max_norm = math.inf if self.cfg.training.max_norm is None else self.cfg.training.max_norm
        grad_norm = self.model.gradients.finish(self.model, max_norm, self.optimizer)  # the parallelize function's
        # A non-finite step still updates the weights here; reading its values stops the run before anything is saved.
        self.optimizer.step()
        self.lr_scheduler.step()
        return losses, grad_norm

    def train(self) -> dict[str, float]:
        """The loop (docs/design.md, "A training step"): a step, its metrics when due, validation and a save when due,
        a stop when every rank has agreed on one. Returns the last read step's values."""
        cfg, last = self.cfg, self.cfg.training.steps
        if self.step >= last and self.rank == 0:
            logger.info("nothing to train: resumed at step %d, and training.steps is %d (raise it to train on)",
                        self.step, last)
        data, accum = iter(self.dataloader), self.layout.grad_accum_steps
        self.model.train()
        with GarbageSchedule(cfg.training.gc_freq) as garbage, \
                StepProfiler(cfg, self.rank, self.device, start_step=self.step) as profiler:
            try:
                while self.step < last:
                    self.step += 1
                    garbage.step(self.step)
                    lr, batches = self.optimizer.param_groups[0]["lr"], [next(data) for _ in range(accum)]
                    self.steps.ran(self.train_step(batches), attended_keys(batches), lr)
                    self._settle_resharding()  # "auto", once the launch's first step's peak is known
                    profiler.step(self.step)
                    self.steps.log_deferred()  # the previous step's record, now that this step is queued
                    validate = self.validator is not None and (self.step % cfg.validation.freq == 0 or self.step == last)
                    stop = self.stop.agreed(self.cpu_group)
                    if self.step % cfg.metrics.log_freq == 0 or self.step in (1, last):
                        self.steps.due(self.step, at_once=self.step in (1, last) or validate or stop or self._save_due())
                    if validate:
                        self.steps.read()  # never validate (or save) weights a non-finite step produced
                        self.metrics.log_validation(self.step, self.validator.validate(self.model))
                        self.steps.paused()
                    saved = self._maybe_save(force=bool(stop))
                    if stop:
                        raise TrainingStopped(self.step, stop, saved)
                self.stop.settle()  # the last boundary's vote, which every rank started
                if self.checkpointer is not None:
                    self.checkpointer.wait()
            finally:
                try:
                    self.stop.settle()  # leaving on a stop or an error: gloo work left in flight at exit aborts
                except Exception:  # noqa: BLE001  (the stop or error on the way out is the one to report)
                    pass
                self.metrics.close()
        return self.steps.last

    def _settle_resharding(self) -> None:
        """parallelism.fsdp_reshard_after_forward = "auto": after the launch's first step, whose peak memory is then
        known, keep the blocks' gathered weights if they fit (parallel/reshard_policy.py)."""
        if self.cfg.parallelism.fsdp_reshard_after_forward != "auto" or self.step != self.first_step + 1:
            return
        self.steps.read()
        line = keep_if_it_fits(self.model, self.device, self.cpu_group)
        if line is not None and self.rank == 0:
            logger.info(line)
        self.steps.paused()

    def _save_due(self) -> bool:
        ckpt = self.cfg.checkpoint
        return self.checkpointer is not None and (self.step % ckpt.interval == 0
                                                  or self.step == self.cfg.training.steps)

    def _maybe_save(self, force: bool) -> str | None:
        """Checkpoint every checkpoint.interval steps, at the last step and when stopping; returns the folder."""
        if self.checkpointer is None or not (self._save_due() or force):
            return None
        self.steps.read()  # raises, saving nothing, if a step since the last read diverged
        path = self.checkpointer.save(self.step, self.run_id)
        if force:
            self.checkpointer.wait()  # the process is about to exit: the save must be complete
        self.steps.paused()
        return str(path)

    def print_summary(self) -> None:
        """Rank 0: what the run did and where its outputs are."""
        if self.rank != 0:
            return
        cfg, folder = self.cfg, os.path.abspath(self.cfg.job.dump_folder)
        steps = self.step - self.first_step  # this launch's
        tokens = steps * self.layout.global_batch_size * cfg.training.seq_len
        outputs = ["metrics.jsonl", "config.toml"]
        if self.metrics.tb_dir is not None:
            outputs.append(os.path.relpath(self.metrics.tb_dir, folder) + "/")
        if cfg.checkpoint.export_hf_at_end:
            outputs += [os.path.relpath(f, folder) + "/" for f in self._export_folders(self.export_folder)]
        resumed = f" (resumed at step {self.first_step}, now {self.step})" if self.first_step else ""
        work = (f"{steps} step{'s' if steps != 1 else ''}{resumed}, {tokens:,} tokens in {time.perf_counter() - self.started:.0f} s, final loss "
                f"{self.steps.last['loss']:.4f}" if steps else
                f"nothing to train: step {self.step} of training.steps {cfg.training.steps} already done")
        print(f"[{cfg.job.name}] done: {work}; outputs in {folder}: {', '.join(outputs)}", flush=True)

    @property
    def export_folder(self) -> str:
        return os.path.join(self.cfg.job.dump_folder, EXPORT)

    def _export_folders(self, folder: str) -> list[str]:
        """The folders an export to `folder` writes: it, and a LoRA run's PEFT adapter beside it."""
        return self.lora.export_folders(folder) if self.lora is not None else [folder]

    def _export_names(self, folder: str) -> str:
        return " and ".join(self._export_folders(folder))

    def export_hf(self) -> None:
        """Write the trained weights as a Hugging Face folder at <dump_folder>/hf, and a LoRA run's PEFT adapter at
        <dump_folder>/hf-adapter: one unit, both of this step or both as they were (hf_weights.ExportUnit).

        A folder that is no longer one an export may replace (something else was put there during the training): the
        export is written beside it, under a new name, and the run ends with one error line saying where. Any other
        failure (a full disk) ends with one line saying exactly what of the run is on disk."""
        self.exporting, started = True, time.perf_counter()
        try:
            written = self._export_to(self.export_folder)
        except ExportRefused as refused:
            beside = self._free_export_folder()
            try:
                self._export_to(beside)
            except CheckpointError as failed:
                raise CheckpointError(f"{refused}; writing the export beside it, to {beside}, failed too: {failed}; "
                                      f"{self.what_is_saved()}", every_rank=True) from None
            self.exporting = False
            raise ExportRefused(f"{refused}; this run's export was written beside it instead: "
                                f"{self._export_names(beside)}", every_rank=True) from None
        except CheckpointError as failed:
            raise CheckpointError(f"{failed}; {self.what_is_saved()}", every_rank=True) from None
        self.exporting = False
        if self.rank == 0:
            print(f"[{self.cfg.job.name}] exported {written} in {time.perf_counter() - started:.1f} s", flush=True)

    def _export_to(self, folder: str) -> str:
        """The export (and a LoRA run's adapter) written to `folder` as one unit; returns what was written."""
        dtype = DTYPES[self.cfg.checkpoint.export_dtype]
        with ExportUnit() as unit:
            self.export_unit = unit
            quantized = self.cfg.checkpoint.export_quantized
            if self.lora is not None:  # merged, and the PEFT adapter beside it
                self.lora.export(self.model, self.model_args, folder, dtype, self.tokenizer, unit, quantized=quantized)
            else:
                export_hf(self.model, self.model_args, folder, dtype, tokenizer=self.tokenizer, unit=unit,
                          quantized=quantized)
        return " and ".join(os.path.abspath(written) for _, written in unit.written)

    def _free_export_folder(self) -> str:
        """A new name beside the export folder for this step's export (and its adapter's): <hf>-step-N[.k]."""
        base, n = f"{os.path.abspath(self.export_folder)}-step-{self.step}", 0
        folder = base
        while any(os.path.lexists(f) for f in self._export_folders(folder)):
            n += 1
            folder = f"{base}.{n}"
        return folder

    def what_is_saved(self) -> str:
        """What of this run is on disk, in a few words, for the line of a run stopped before its end (Ctrl-C twice)
        or whose export failed."""
        names, pair = self._export_names(self.export_folder), len(self._export_folders(self.export_folder)) > 1
        if self.export_unit is not None and self.export_unit.published:
            export = f"the export is written, {names}, {'both ' if pair else ''}of step {self.step}; "
        elif self.exporting:
            export = (f"the Hugging Face export to {names} {'were' if pair else 'was'} not written (the earlier "
                      f"{'pair' if pair else 'one'} there is left as it was); ")
        else:
            export = ""
        complete = step_folders(self.checkpointer.folder) if self.checkpointer is not None else {}
        if not complete:
            return export + ("no checkpoint of this run is saved" if self.checkpointer is not None else
                             "checkpointing is off: no checkpoint of this run is saved")
        last = max(complete)
        convert = (f"; python -m harness.convert {complete[last]} <folder> exports it" if self.exporting
                   and last == self.step else "")
        return export + f"the last complete checkpoint is step-{last} ({complete[last]}), which a relaunch resumes{convert}"

    def close(self) -> None:
        if hasattr(self.dataloader, "close"):  # a streaming loader's prefetch thread
            self.dataloader.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self.run_lock.release()
