"""The one validation pass over a config: every problem it finds, in one list, none raised at the first.

`config_problems(cfg, world_size, rejected, run_requirements)` checks, in this order:
  1. values: every float finite, every numeric key inside its range (_RANGES), and the checks between keys (a warmup
     that runs into the decay phase; profile_freq where profiling is on);
  2. given a world size, the parallel layout: degrees that fit the world size (parallel/parallel_dims.py), a global
     batch that is a multiple of local_batch_size x the data-parallel degree;
  3. given run_requirements, what the run reads (harness/config/run_requirements.py): paths, model flavor,
     tokenizer, chat template, the context- and expert-parallel degrees against the model.
A check is skipped where it reads a key whose given value was refused (`rejected`: the default standing in for it
would be judged) or already named out of range (it would be named twice). Runs without torch: a launch's typo is
named in well under a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from models.qwen35_moe.lora_targets import TARGETS as LORA_TARGETS
from parallel.parallel_dims import ParallelDims

from ..gpus import processes_per_node, visible_gpus
from ..lora.settings import lora_config_problems
from ..memory_check import launch_memory_problem
from .errors import ConfigError
from .run_requirements import model_args_of, run_requirement_problems
from .schema import ALL_KEYS, JobConfig, get_value

_DEGREE_KEYS = ("parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
                "parallelism.context_parallel_degree", "parallelism.expert_parallel_degree")
_BATCH_KEYS = ("training.local_batch_size", "training.global_batch_size")
# What the memory check reads (harness/memory_check.py)
_MEMORY_KEYS = ("training.local_batch_size", "training.seq_len", "training.loss_chunk_tokens", "lora.enable",
                "lora.rank", "lora.expert_rank", "lora.targets", "lora.mtp", "lora.fp8_base", "training.mtp_loss_coef",
                "model.flavor", "model.hf_config", "model.mtp_num_hidden_layers", "checkpoint.initial_load_hf")


def _at_least(low):
    return lambda v: v >= low


def _positive(v) -> bool:
    return v > 0


# The values each numeric key accepts, and how its problem reads: "<key> must be <what>, got <value>". Floats are
# also checked finite (nan and inf pass no range check, and would crash torch or the run later). The parallel
# degrees and training.global_batch_size are checked against the world size (the layout);
# profiling.profile_freq only where profiling is on (_value_problems).
_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "job.other_run_outputs_keep": (_at_least(0), ">= 0 (0 keeps all)"),
    "model.mtp_num_hidden_layers": (_at_least(-1), "-1 (the model's own) or >= 0"),
    "training.steps": (_positive, "positive"),
    "training.seq_len": (_positive, "positive"),
    "training.local_batch_size": (_positive, "positive"),
    "training.max_norm": (lambda v: v is None or v > 0, "positive, or none for no clipping"),
    "training.seed": (lambda v: -2 ** 63 <= v < 2 ** 64, "in [-2**63, 2**64) (what torch.manual_seed takes)"),
    "training.chat_max_row_bytes": (lambda v: v == -1 or v > 0, "-1 (derived from seq_len) or positive"),
    "training.aux_loss_coef": (lambda v: v == -1 or v >= 0, "-1 (the model's router_aux_loss_coef) or >= 0"),
    "training.mtp_loss_coef": (_at_least(0), ">= 0 (0: MTP layers frozen)"),
    "training.loss_chunk_tokens": (_at_least(0), ">= 0 (0: all tokens at once)"),
    "training.gc_freq": (_at_least(0), ">= 0 (0: Python's own schedule)"),
    "validation.freq": (_positive, "positive"),
    "validation.steps": (lambda v: v > 0 or v == -1, "positive or -1 (the whole set)"),
    "optimizer.lr": (_positive, "positive"),
    "optimizer.eps": (_positive, "positive"),  # 0 divides 0 by 0 for a parameter whose gradients are all 0
    "optimizer.weight_decay": (_at_least(0), ">= 0"),
    "optimizer.betas": (lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "two values in [0, 1) (beta1, beta2)"),
    "lr_scheduler.warmup_steps": (_at_least(0), ">= 0"),
    "lr_scheduler.decay_ratio": (lambda v: v is None or 0 <= v <= 1, "in [0, 1] or none"),
    "lr_scheduler.min_lr_factor": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "metrics.log_freq": (_positive, "positive"),
    "checkpoint.interval": (_positive, "positive"),
    "checkpoint.keep_latest_k": (_at_least(0), ">= 0 (0 keeps all)"),
    "checkpoint.load_step": (_at_least(-1), "a step or -1 (the latest)"),
    "lora.rank": (lambda v: v > 0 and v % 8 == 0, "a positive multiple of 8"),
    "lora.expert_rank": (lambda v: v >= 0 and v % 8 == 0, "0 (lora.rank) or a positive multiple of 8"),
    "lora.alpha": (_positive, "positive"),
    "lora.dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "lora.targets": (lambda v: v and set(v) <= set(LORA_TARGETS), f"a non-empty list of {', '.join(LORA_TARGETS)}"),
}


@dataclass(frozen=True)
class RunLayout:
    """How a run's ranks and rows are arranged: parallel degrees, global batch and gradient accumulation."""

    dims: ParallelDims
    global_batch_size: int  # rows per optimizer step over all data-parallel ranks
    grad_accum_steps: int  # micro-batches per optimizer step on each rank


def config_problems(cfg: JobConfig, world_size: int | None = None, rejected: frozenset[str] = frozenset(),
                    run_requirements: bool = False) -> list[str]:
    """Every problem of `cfg`: its values; its parallel layout on `world_size` ranks (when given); what the run reads
    (with `run_requirements`). Checks reading a key in `rejected` are skipped."""
    problems, unusable = _range_problems(cfg, ALL_KEYS, rejected)
    problems += _between_keys_problems(cfg, rejected | unusable)
    layout = None
    if world_size is not None:
        layout, layout_problems = _layout(cfg, world_size, rejected | unusable)
        problems += layout_problems
    if run_requirements:
        problems += run_requirement_problems(cfg, rejected)
        if layout is not None and not (rejected | unusable) & set(_MEMORY_KEYS):
            problems += _memory_problems(cfg, layout)
    return problems


def _memory_problems(cfg: JobConfig, layout: RunLayout) -> list[str]:
    """Whether the run can fit this host (a CPU run) or any GPU (harness/memory_check.py), judged where its model is
    known."""
    args, _ = model_args_of(cfg)
    if args is None:  # named by the run requirements
        return []
    gpu_run = visible_gpus() > 0
    problem = launch_memory_problem(cfg, args, layout.dims.world_size, layout.dims.cp, gpu_run, processes_per_node())
    return [problem] if problem else []


def validate_parallelism(cfg: JobConfig, world_size: int) -> RunLayout:
    """The resolved layout of `cfg` on `world_size` ranks (for callers holding a config, not a launch's command
    line: the trainer); a ConfigError naming what makes it impossible."""
    problems, unusable = _range_problems(cfg, _DEGREE_KEYS + _BATCH_KEYS, frozenset())
    layout, layout_problems = _layout(cfg, world_size, unusable)
    if problems or layout_problems:
        raise ConfigError(problems + layout_problems)
    return layout


def _finite(value) -> bool:
    values = value if isinstance(value, list) else [value]
    return all(math.isfinite(v) for v in values if isinstance(v, float))


def _range_problems(cfg: JobConfig, keys, rejected: frozenset[str]) -> tuple[list[str], frozenset[str]]:
    """(problems, the keys named) of `keys` whose values are not finite or outside their range; rejected keys
    are passed over (and counted among those named: nothing may read them)."""
    problems, named = [], set(rejected)
    for key in keys:
        if key in rejected:
            continue
        value = get_value(cfg, key)
        if not _finite(value):
            problems.append(f"{key} must be {'finite numbers' if isinstance(value, list) else 'a finite number'}, "
                            f"got {value}")
        elif key in _RANGES and not _RANGES[key][0](value):
            problems.append(f"{key} must be {_RANGES[key][1]}, got {value}")
        else:
            continue
        named.add(key)
    return problems, frozenset(named)


def _between_keys_problems(cfg: JobConfig, unusable: frozenset[str]) -> list[str]:
    """Values each inside its range that no run can use together; a check reading an unusable key is skipped."""
    problems = []
    ratio = cfg.lr_scheduler.decay_ratio
    if ratio is not None and not unusable & {"lr_scheduler.decay_ratio", "lr_scheduler.warmup_steps",
                                             "training.steps"}:
        steps, warmup = cfg.training.steps, cfg.lr_scheduler.warmup_steps
        decay_start = steps - round(steps * ratio)
        if warmup > decay_start:  # the lr would jump from the warmup ramp into the middle of the decay
            problems.append(f"lr_scheduler.warmup_steps = {warmup} runs into the decay phase, which starts after step "
                            f"{decay_start} (training.steps {steps} * (1 - decay_ratio {ratio})); lower warmup_steps "
                            f"or decay_ratio")
    problems += lora_config_problems(cfg, unusable)
    q = cfg.quantize
    if cfg.lora.enable and not unusable & {"quantize.linear_float8_recipe", "quantize.grouped_mm_float8_fqns",
                                            "lora.enable"} and (q.linear_float8_recipe != "none"
                                                                or q.grouped_mm_float8_fqns):
        problems.append("FP8 training (quantize.linear_float8_recipe, quantize.grouped_mm_float8_fqns) trains the "
                        "model's weights in FP8; with lora.enable they are frozen (their weight gradients would be "
                        "computed for nothing): set quantize.linear_float8_recipe none and "
                        "quantize.grouped_mm_float8_fqns [] for LoRA")
    p = cfg.profiling
    if (p.enable_profiling or p.enable_memory_snapshot) and "profiling.profile_freq" not in unusable \
            and p.profile_freq < 2:
        problems.append(f"profiling.profile_freq must be >= 2 (a warm-up step, then the traced one), got "
                        f"{p.profile_freq}")
    return problems


def _layout(cfg: JobConfig, world_size: int, unusable: frozenset[str]) -> tuple[RunLayout | None, list[str]]:
    """The layout on `world_size` ranks, or None and what makes it impossible: the degrees first (unless one is
    unusable), then the global batch (unless a batch key is)."""
    if unusable & set(_DEGREE_KEYS):
        return None, []
    p = cfg.parallelism
    try:
        dims = ParallelDims.resolve(p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
                                    p.context_parallel_degree, p.expert_parallel_degree, world_size)
    except ValueError as e:
        return None, [str(e)]
    if unusable & set(_BATCH_KEYS):
        return None, []
    local, gbs = cfg.training.local_batch_size, cfg.training.global_batch_size
    per_step = local * dims.dp  # rows per micro-step over all data-parallel ranks
    if gbs == -1:
        gbs = per_step
    if gbs <= 0 or gbs % per_step:
        return None, [f"training.global_batch_size = {cfg.training.global_batch_size} must be -1 or a positive "
                      f"multiple of local_batch_size * dp degree = {local} * {dims.dp} = {per_step}"]
    return RunLayout(dims, gbs, gbs // per_step), []
