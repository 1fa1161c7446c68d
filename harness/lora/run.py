"""A run's LoRA: one part, built once, that the trainer touches at build and at export only and the converter uses
as it is (torchtitan's model converters are the pattern: convert the model, choose what a checkpoint holds,
transform the export). Built from the config (`LoraRun.from_config`, None without LoRA) or, in the converter, from
the record a LoRA checkpoint holds (`from_record`).

What it owns:
- the model's conversion (`convert`): adapters on `lora.targets` (models/qwen35_moe/lora.py), every other weight
  frozen and, on a GPU, held in the compute dtype (no gradient, optimizer state or fp32 master); whether the MTP
  layers train (`trains_mtp`: only with adapters on them);
- what its checkpoints hold: the trained parameters alone (the checkpointer saves what requires a gradient for a
  run with a record) and `record`, the adapters' settings and the digest of the frozen base (base.py), which a
  resume (base.lora_problem) and the converter check;
- the FLOPs the adapters add (`adapter_flops_params`, for MFU);
- the exports, one unit: the merged model (each adapted weight W + s B A, merge.py) at the export folder and the
  PEFT adapter beside it (peft.py), from the trained model (`export`, the end of a run) or from a checkpoint's
  adapters and the base they were trained on (`write_exports`, the converter).

How a capability of LoRA lands: inside this part and the model's LoRA files.
- A separate rank for the routed experts (`lora.expert_rank`, PEFT's rank_pattern) did so: a LoraArgs field
  (models/qwen35_moe/lora_targets.py, with the experts' scale alpha / expert_rank), read by settings.py, built by
  ExpertLowRank (lora.py), counted by sizes.py, merged at its own scale (merge.py's `scale_of`), and written to the
  PEFT config as `rank_pattern` (peft.py).
- An FP8 frozen base (the official FP8 release) did too: `convert` holds each quantized weight as float8_e4m3fn with
  its block scales (`fp8_held_keys`, models/qwen35_moe/fp8_hold.py) instead of casting it to the compute dtype, the
  loading copies them as stored, the base's reading and digest (base.py) take the FP8 folder, and the exports read W
  dequantized before W + s B A.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from models.qwen35_moe import Qwen35MoeArgs, Qwen35MoeModel
from models.qwen35_moe.hf_checkpoint import MAX_SHARD_BYTES
from models.qwen35_moe.lora import (
    ExpertLowRank,
    active_adapter_params,
    adapted_modules,
    adapter_shapes,
    add_adapters,
    hold_frozen_in,
)
from models.qwen35_moe.lora_targets import LoraArgs, is_adapter_key

from ..checkpoint.errors import CheckpointError
from ..checkpoint.hf_weights import (
    ExportUnit,
    hf_fp8_tensors,
    hf_native_tensors,
    model_native_tensors,
    write_native_export,
)
from ..run_outputs import adapter_folder
from .base import base_digest, lora_record
from .merge import adapter_merges, merged_reads
from .peft import write_peft_adapter
from .settings import lora_args_of

logger = logging.getLogger(__name__)


class LoraRun:
    """The LoRA of a run: its adapters (`args`) and the base they train on (`base`, an HF folder; "": drawn from
    `seed`)."""

    def __init__(self, args: LoraArgs, base: str, seed: int | None):
        self.args, self.base, self.seed = args, base, seed

    @classmethod
    def from_config(cls, cfg) -> LoraRun | None:
        args = lora_args_of(cfg)
        return None if args is None else cls(args, cfg.checkpoint.initial_load_hf, cfg.training.seed)

    @classmethod
    def from_record(cls, record: dict, seed: int | None, base: str | None = None) -> LoraRun:
        """The LoRA of the run that saved a checkpoint, from its train state's "lora" record (`record`); `base`: the
        base's folder where it is no longer where the run loaded it from."""
        args = LoraArgs(**{**record["args"], "targets": tuple(record["args"]["targets"])})
        return cls(args, record["base"]["source"] if base is None else base, seed)

    # ---- building the run ----

    def convert(self, model: nn.Module, hold_dtype: torch.dtype | None, fp8: frozenset[str] = frozenset()) -> None:
        """Add the adapters to `model` (on any device, meta too) and freeze every other weight; `hold_dtype`: the
        dtype the frozen weights are held in (a GPU's compute dtype; None: as they are); `fp8`: the keys of those
        held as the FP8 release stores them instead (`fp8_held_keys`)."""
        adapted = add_adapters(model, self.args)
        logger.info("LoRA: rank %d, alpha %g, on %d modules (%s); every other weight frozen", self.args.rank,
                    self.args.alpha, adapted, ", ".join(self.args.targets))
        hold_frozen_in(model, hold_dtype, fp8)

    def fp8_held_keys(self, model_args: Qwen35MoeArgs, expert_parallel: bool, full_ac: bool,
                      asked: str = "held") -> frozenset[str]:
        """The base's weights to hold in FP8: those an FP8 release base stores quantized, where `asked`
        (lora.fp8_base) is "held" and the run, in one process or under FSDP, has no expert parallelism and runs
        full activation checkpointing (else none: they are held dequantized, and the log says why). Under expert
        parallelism a rank's experts would need their own slice of the scales; without full AC the backward would
        keep every block's dequantized weights, more than a bf16 base holds."""
        try:
            keys = hf_fp8_tensors(self.base, model_args)[0] if self.base else frozenset()
        except (OSError, ValueError):  # the loading names what is wrong with the folder, in one error line
            return frozenset()
        if keys and not (asked == "held" and not expert_parallel and full_ac):
            logger.info("LoRA: the FP8 base's %d quantized weights are held dequantized, in the compute dtype: %s",
                        len(keys), "lora.fp8_base is dequantized" if asked != "held"
                        else "FP8 holding does not shard the experts by expert parallelism" if expert_parallel
                        else "FP8 holding needs activation_checkpoint.mode full")
            return frozenset()
        if keys:
            logger.info("LoRA: the FP8 base's %d quantized weights held as stored (float8_e4m3fn and 128 x 128 block "
                        "scales), dequantized where each module computes", len(keys))
        return keys

    @property
    def trains_mtp(self) -> bool:
        """Whether the MTP layers carry adapters (else they stay frozen as loaded, never run)."""
        return self.args.mtp

    def record(self, model_args: Qwen35MoeArgs, device_type: str) -> dict:
        """What the run's checkpoints hold of its LoRA: the adapters' settings and the digest of the base."""
        return lora_record(self.args, self.base, self.seed, model_args, device_type)

    def adapter_flops_params(self, model: nn.Module, top_k: int, train_mtp: bool) -> int:
        """The adapter parameters one token touches: their share of a step's FLOPs (harness/metrics.py)."""
        return active_adapter_params(model, top_k, train_mtp)

    # ---- exports ----

    def export_folders(self, folder: str) -> list[str]:
        """The folders an export to `folder` writes: the merged model and the PEFT adapter beside it."""
        return [folder, adapter_folder(folder)]

    def export(self, model: nn.Module, model_args: Qwen35MoeArgs, folder: str | Path, dtype: torch.dtype, tokenizer,
               unit: ExportUnit, max_shard_bytes: int = MAX_SHARD_BYTES, quantized: str = "none") -> list[str]:
        """The end-of-run exports of the trained (possibly sharded) model (`write_exports`): every rank calls this
        alike."""
        shapes, read = model_native_tensors(model)
        adapters = {k: s for k, s in shapes.items() if is_adapter_key(k)}
        scales = {name: module.adapter.scale for name, module in adapted_modules(model)}
        expected = {name: self.args.expert_scale if isinstance(module.adapter, ExpertLowRank) else self.args.scale
                    for name, module in adapted_modules(model)}
        if adapters != adapter_shapes(model_args, self.args) or scales != expected:
            raise CheckpointError(f"the model's adapters are not those of rank {self.args.rank} (experts "
                                  f"{self.args.experts_rank}) on "
                                  f"{', '.join(self.args.targets)} (mtp {self.args.mtp}) with alpha "
                                  f"{self.args.alpha:g}: the exports would misstate them", every_rank=True)
        return self.write_exports(folder, model_args, dtype, shapes, read, unit, tokenizer=tokenizer,
                                  max_shard_bytes=max_shard_bytes, quantized=quantized)

    def write_exports(self, folder: str | Path, model_args: Qwen35MoeArgs, dtype: torch.dtype,
                      shapes: dict[str, tuple[int, ...]], read: Callable[[str], torch.Tensor], unit: ExportUnit,
                      tokenizer=None, extra_files=None, max_shard_bytes: int = MAX_SHARD_BYTES,
                      source: str | Path | None = None, quantized: str = "none") -> list[str]:
        """The merged model at `folder` and the PEFT adapter beside it, into `unit`, from native tensors (the base's
        weights and the adapters' factors alike: `shapes`, each read whole by `read`); `source`: the checkpoint
        they come from (the converter's); `quantized` "fp8": the merged model re-quantized into the FP8 release's
        layout. Returns what the PEFT folder leaves out or states otherwise."""
        merges = adapter_merges(shapes, self.args.scale_of)
        logger.info("LoRA: %d adapted weights written merged (W + s * B A, summed in fp32)", len(merges))
        base = {k: s for k, s in shapes.items() if not is_adapter_key(k)}
        merged_dtype = torch.float32 if quantized == "fp8" else dtype  # quantized from W + s B A unrounded
        write_native_export(folder, model_args, dtype, base, merged_reads(read, merges, merged_dtype), tokenizer,
                            max_shard_bytes, unit, extra_files, source, quantized)
        adapters = {k: s for k, s in shapes.items() if is_adapter_key(k)}
        return write_peft_adapter(adapter_folder(folder), self.args, adapters, read, self.base or None, source, unit)

    # ---- a checkpoint's adapters, for the converter ----

    def adapters_problem(self, model_args: Qwen35MoeArgs, adapters: dict[str, tuple[int, ...]]) -> str | None:
        """Why a checkpoint's `adapters` (key -> shape) are not the ones this LoRA describes; None if they are."""
        expected = adapter_shapes(model_args, self.args)
        if adapters == expected:
            return None
        differ = sorted(adapters.keys() ^ expected.keys()) or sorted(k for k in adapters if adapters[k] != expected[k])
        return (f"its adapters are not those its train state describes (rank {self.args.rank} on "
                f"{', '.join(self.args.targets)}): {', '.join(differ[:4])} ({len(differ)} in all)")

    def base_problem(self, model_args: Qwen35MoeArgs, saved: dict) -> str | None:
        """Why this run's base is not the one the saved record (`saved`: its "base" entry) names: not there, or
        another digest; None if it is the same."""
        if not self.base and self.seed is None:
            return ("its base was drawn from the seed, and its train state holds no run config to read the seed "
                    "from: pass --base with the base's HF folder")
        if self.base and not Path(self.base).exists():
            return (f"its adapters were trained on the base {self.base}, which is not there: pass --base with that "
                    "base's HF folder")
        try:
            ours = base_digest(self.base, self.seed, model_args)  # a seed's base is drawn again here, on the CPU
        except (OSError, ValueError) as e:  # a damaged or hostile safetensors file
            return f"the base {self.base}: {e}"
        if ours != saved["digest"]:
            return (f"its adapters were trained on the base {saved['source'] or 'drawn from the seed'} (digest "
                    f"{saved['digest']}); the base {self.base or 'drawn from the seed'} has digest {ours}: pass --base "
                    "with the base they were trained on")
        return None

    def base_tensors(self, model_args: Qwen35MoeArgs) -> tuple[dict[str, tuple[int, ...]],
                                                              Callable[[str], torch.Tensor]]:
        """The base's native tensors: {key: shape} and the reader of one, from its HF folder, or drawn again from the
        seed on the CPU (the whole model in memory: debug sizes). OSError / ValueError for a folder that cannot be
        read."""
        if self.base:
            return hf_native_tensors(self.base, model_args)
        with torch.device("meta"):
            model = Qwen35MoeModel(model_args)
        model.to_empty(device="cpu")
        model.init_weights(self.seed)  # as the run drew it (on the CPU; models/qwen35_moe/init.py)
        state = model.state_dict()
        return {k: tuple(v.shape) for k, v in state.items()}, state.__getitem__
