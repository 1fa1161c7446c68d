"""Run configuration: one TOML file describes a run; any key can be overridden on the command line.

    cfg = load_config(["--config", "train_configs/debug_model.toml", "--training.steps", "100"])
    layout = validate_parallelism(cfg, world_size)  # parallel degrees, global batch, accumulation

Sections and keys follow torchtitan's JobConfig names where an equivalent exists. Each section is a
plain dataclass; its field comments are the documentation (`--help` prints them). Field types drive parsing:
`Literal[...]` fields are choices, `float | None` accepts "none", `list[float]` accepts "0.9,0.95" on the CLI.
Loading names every problem it finds at once (unknown keys, wrong types, bad values), not the first one; entry
points check a launch through `preflight.check_launch`, which adds the parallel degrees and the paths, and print the
ConfigError as one `error: ...` line, exit code 2 (`exit_on_config_error`).

Relative paths: the input paths of INPUT_PATH_KEYS written in a config file are relative to that file's folder
(a config travels with its data); on the command line, and for outputs (job.dump_folder,
training.dataset_cache_dir), they are relative to the current directory. `to_toml` writes a loaded config back,
every path absolute, so `--config <dump_folder>/config.toml` repeats a run from anywhere.
"""

import dataclasses
import difflib
import json
import math
import os
import sys
import tomllib
import types
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, NoReturn, Union, get_args, get_origin, get_type_hints

from parallel.parallel_dims import ParallelDims


class ConfigError(ValueError):
    """Bad configuration input: every problem found (`problems`, each naming the file or key at fault), numbered
    in one message when there are several.

    From `load_config`, also what loaded despite them: `partial`, the config with each rejected value left at its
    default (None when no config could be read: a missing or malformed file), and `rejected`, the keys whose given
    values were refused, so that later checks skip what would only report the stand-in default."""

    def __init__(self, problems: str | list[str], partial: "JobConfig | None" = None,
                 rejected: frozenset[str] = frozenset()):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.partial, self.rejected = partial, rejected
        super().__init__(describe_problems(self.problems))


def describe_problems(problems: list[str]) -> str:
    """One problem as it is; several numbered (their own texts may hold semicolons)."""
    if len(problems) == 1:
        return problems[0]
    return f"the run cannot start, {len(problems)} problems: " + " ".join(
        f"({i}) {p}{';' if i < len(problems) else ''}" for i, p in enumerate(problems, 1))


@dataclass
class Job:
    name: str = "qwen35_moe"  # run name: prefixes every log line and console metrics line
    dump_folder: str = "./outputs"  # metrics, tensorboard, checkpoints and HF export go under here (relative: to the current directory)
    description: str = ""  # free text, kept in the saved config.toml
    # Another run's metrics.jsonl, config.toml and hf/ found in the dump folder by a launch that does not continue that
    # run (harness/run_outputs.py): "keep" renames them <name>-<its run id> (one log line; a resume of that run brings
    # them back), "delete" deletes them (one log line).
    other_run_outputs: Literal["keep", "delete"] = "keep"


@dataclass
class Model:
    name: str = "qwen35_moe"  # the model family (this harness trains one)
    flavor: str = "debugmodel"  # a named model shape from models/qwen35_moe flavors
    # Optional path to a transformers config.json (or its folder); overrides the flavor's shape.
    hf_config: str = ""
    tokenizer_path: str = ""  # empty = the built-in byte tokenizer
    # FLA refuses the gated-delta backward on Hopper with Triton < 3.7.1. "auto" bypasses that guard only
    # where it would trip and a numerical self-check of FLA's gradients on the run's head shapes passes
    # (else the run stops, naming the errors); "off" never bypasses (FLA's own error on such machines).
    fla_hopper_backward: Literal["auto", "off"] = "auto"
    router_force_balance: bool = False  # benchmarks only: MoE routing forced round-robin, equal tokens per expert
    # Multi-token-prediction layers: -1 = as the flavor or config.json has them (the releases: 1); 0 = none, e.g. to
    # resume a checkpoint saved without them or to leave the release's out of the run and its export.
    mtp_num_hidden_layers: int = -1


@dataclass
class Training:
    steps: int = 10  # optimizer steps to run
    seq_len: int = 256  # tokens per row
    local_batch_size: int = 8  # rows per data-parallel rank per micro-batch
    # Rows per optimizer step over all data-parallel ranks; -1 = local_batch_size * dp degree.
    # A larger value (a multiple of that) means gradient accumulation.
    global_batch_size: int = -1
    max_norm: float | None = 1.0  # gradient-norm clipping threshold (> 0); none = no clipping (norm still logged)
    seed: int = 42  # initial weights and any sampling; the same weights at every world size
    deterministic: bool = False  # deterministic algorithms (slower)
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"  # compute dtype (FSDP's param dtype)
    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"  # FSDP gradient reduce dtype
    dataset: Literal["text", "jsonl", "parquet", "hf"] = "text"  # kind of source (see harness/data/sources.py)
    dataset_path: str = ""  # file, folder or HF dataset name, depending on `dataset`
    dataset_text_field: str = "text"  # field holding the text in jsonl / parquet / hf records
    # Tokenized cache of a local dataset (built once per dataset and tokenizer, then memory-mapped);
    # empty = <dump_folder>/dataset_cache. Point runs that share a dataset at one folder.
    dataset_cache_dir: str = ""
    # Checks of that cache each time a run opens it: "quick" (sizes, counts, document starts, token id range and a
    # sampled sha256; well under a second) or "full" (also the sha256 of every token, ~1.5 s a GB). A cache is
    # checked in full right after it is built.
    dataset_cache_verify: Literal["quick", "full"] = "quick"
    # "text": documents, every token a target. "chat": each row is a conversation {"messages": [{"role", "content"},
    # ...], "tools": [...] (optional)}, assistant messages may carry reasoning_content and tool_calls; rendered by
    # the chat template of model.tokenizer_path, packed whole into padded rows (docs/design.md, "Chat data"); from
    # a jsonl, parquet or hf dataset. The validation set is read the same way, with these chat keys.
    data_format: Literal["text", "chat"] = "text"
    chat_messages_field: str = "messages"  # chat: the field (column) of a row that holds its messages
    # chat: the tokens trained on. "assistant": those the template emits for assistant turns (content, the reasoning
    # it keeps, tool calls, the closing <|im_end|>); "all": every token of the rendered conversation.
    chat_targets: Literal["assistant", "all"] = "assistant"
    # chat: a conversation longer than seq_len + 1 tokens is dropped, or truncated to one row (counted in the log)
    chat_overlong: Literal["drop", "truncate"] = "drop"
    # chat: a row larger than this many bytes (its jsonl line; for parquet and hf rows, the UTF-8 bytes of its
    # strings) is left out before it is parsed, rendered or tokenized, counted with the rows that cannot be trained
    # on: a conversation far longer than a row would only be dropped or cut, after seconds and gigabytes of work.
    # -1 = 16 bytes a token of a row, 16 * (seq_len + 1); raise it for rows of more bytes a token (JSON escapes of
    # non-Latin text: 6 bytes a character). The chat cache is keyed by it: another seq_len builds another cache.
    chat_max_row_bytes: int = -1
    aux_loss_coef: float = -1.0  # MoE load-balance loss weight; -1 = router_aux_loss_coef of the model
    # Weight of the multi-token-prediction loss (the mean over the MTP depths of each one's token-mean cross entropy
    # of x_{t+k+2}), for a model with MTP layers (the releases' config.json; flavors 35B-A3B ...): 0.1 as Megatron's
    # default. 0: the MTP layers are neither run nor trained, carried frozen from the initial weights to the export.
    mtp_loss_coef: float = 0.1
    # Cross entropy this many tokens at a time (per rank), never holding the whole (tokens x vocab) logits;
    # 0 = all at once. Peak per chunk token ~2 bytes x vocab on CUDA (bf16 logits, their gradient written in place:
    # 0.5 GiB for 1024 tokens of a 248k vocab), ~6 elsewhere; + an fp32 lm_head grad. 4096 is faster and holds
    # more (docs/performance.md, "One GPU against a plain transformers training loop").
    loss_chunk_tokens: int = 1024
    # Python's cyclic garbage collector runs every N steps (its young generations), not whenever allocations
    # trigger it: a collection pauses the host mid-step, and with the GPU fed by the host (compile.enable) that
    # stalls the GPU too. 0 = Python's own schedule.
    gc_freq: int = 50


@dataclass
class Validation:
    enable: bool = False  # held-out loss every `freq` steps and at the last step
    dataset: Literal["text", "jsonl", "parquet", "hf"] = "jsonl"  # kind of the held-out source
    dataset_path: str = ""  # file, folder or HF dataset name, depending on `dataset`
    dataset_text_field: str = "text"  # field holding the text in jsonl / parquet / hf records
    freq: int = 100  # validate every N training steps (and after the last one)
    steps: int = 10  # micro-batches per validation (training's local_batch_size and seq_len); -1 = the whole set


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam"] = "AdamW"  # AdamW decouples weight decay; Adam applies it as L2
    lr: float = 8e-4  # peak learning rate
    eps: float = 1e-8  # Adam's epsilon
    weight_decay: float = 0.1  # on matrices only, never on 1-D parameters (norms, A_log, dt_bias)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # CLI: "0.9,0.95"


@dataclass
class LRScheduler:
    warmup_steps: int = 2  # linear warmup from ~0 to lr
    # None = decay over all steps after warmup; else the fraction of steps in the final decay
    # phase, with a constant lr between warmup and decay (warmup-stable-decay).
    decay_ratio: float | None = None
    decay_type: Literal["linear", "sqrt", "cosine"] = "cosine"
    min_lr_factor: float = 0.1  # lr at the end of decay, as a fraction of lr


@dataclass
class Metrics:
    log_freq: int = 1  # log every N steps
    enable_tensorboard: bool = True  # events under <dump_folder>/<save_tb_folder>/<run start time>
    save_tb_folder: str = "tb"  # under dump_folder


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1  # DDP / HSDP replicas
    data_parallel_shard_degree: int = -1  # FSDP shards; -1 = the rest of the world
    context_parallel_degree: int = 1  # ranks that split every row (zigzag); divides the GDN heads and seq_len / 2
    expert_parallel_degree: int = 1  # splits the experts; divides dp_shard * cp, a multiple of cp, divides the experts
    # How tokens reach their experts' ranks (parallel/expert_parallel.py). "all_gather": every rank gathers the EP
    # group's tokens, a reduce-scatter returns the outputs; no host sync, compiles whole, moves ep / top_k of the
    # all-to-all's bytes but holds ep x its MoE buffers. "all_to_all": tokens travel only to their experts' ranks;
    # one host sync per layer. "auto": all_gather while ep <= top_k / 2 (faster than the all-to-all at EP=2 and
    # EP=4: docs/performance.md, "Expert parallelism"), all_to_all above.
    expert_parallel_dispatch: Literal["auto", "all_gather", "all_to_all"] = "auto"
    # "auto" (the default): "default" for a launch's first step, then "never" if that step's peak plus the blocks'
    # gathered weights fit in 85% of every rank's GPU memory (parallel/reshard_policy.py; on CPU "default"); faster
    # than "default" for a little memory (docs/performance.md, "FSDP over 2 GPUs against one GPU"). "never": each
    # block keeps its gathered (bf16) weights from forward to backward, sparing the backward's all-gathers and
    # casts, whatever the memory. "default" = "always" (torchtitan's): every block but the last frees them after
    # forward.
    fsdp_reshard_after_forward: Literal["default", "always", "never", "auto"] = "auto"
    # The embedding and the lm_head vocabulary-parallel (parallel/vocab_parallel.py): their weights stay sharded by
    # rows and each rank serves its rows to every rank's tokens, so FSDP never gathers them nor reduces their whole
    # gradients. "auto": where that moves fewer bytes (FSDP ranks x tokens per rank <= vocabulary size).
    vocab_parallel: Literal["auto", "always", "never"] = "auto"


@dataclass
class Checkpoint:
    enable: bool = False  # DCP checkpoints, and resume from the latest complete one in this dump folder
    folder: str = "checkpoint"  # under dump_folder; DCP steps saved as step-N/
    interval: int = 500  # save every N steps (and at the last step)
    keep_latest_k: int = 2  # older step folders are deleted; 0 = keep all
    async_mode: Literal["disabled", "async"] = "disabled"  # "async": write in the background while training goes on
    export_hf_at_end: bool = False  # write a Hugging Face folder to <dump_folder>/hf at the end
    export_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"  # A_log, dt_bias, GDN norm: always F32
    initial_load_hf: str = ""  # HF checkpoint folder to initialise weights from (when none to resume)
    # Step to resume from; -1 = the newest that verifies. An older step rolls back: the later ones are moved to
    # <folder>/abandoned-<time>/. Like restart_data, a one-off: the saved config.toml holds the default.
    load_step: int = -1
    # Resume the weights, optimizer and schedule but read the data from its start: what a changed dataset,
    # tokenizer or training.seq_len needs (their saved data position would point into other rows).
    restart_data: bool = False


@dataclass
class ActivationCheckpoint:
    # "full": recompute every block in backward (with compile.enable, in two halves, the MoE half's recompute
    # compiled into the backward: parallel/activation_checkpointing.py); "selective": keep matmul, attention and
    # collective outputs, recompute the elementwise work between them (less memory than none, less recompute than
    # full; with compile.enable it recomputes the compiled graphs whole and is slower than full: docs/performance.md,
    # "Activation checkpointing")
    mode: Literal["none", "full", "selective"] = "none"


@dataclass
class Compile:
    # torch.compile each transformer block (every GPU figure in docs/performance.md is compiled); a run compiles in
    # its first steps, then never again. Off by default: not yet run under CP on GPUs.
    enable: bool = False


@dataclass
class Profiling:
    enable_profiling: bool = False  # torch.profiler trace of one step in every profile_freq steps, per rank
    save_traces_folder: str = "profile_traces"  # under dump_folder: iteration_N/rank{R}_trace.json
    profile_freq: int = 10  # trace steps N = profile_freq, 2 * profile_freq, ... (the step before warms up)
    # CUDA allocator history (every allocation with its stack), dumped at the same steps for
    # https://pytorch.org/memory_viz; CUDA only
    enable_memory_snapshot: bool = False
    save_memory_snapshot_folder: str = "memory_snapshot"  # under dump_folder: iteration_N/rank{R}_memory_snapshot.pickle


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    profiling: Profiling = field(default_factory=Profiling)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


# section name -> {key: type hint}
_SCHEMA = {f.name: get_type_hints(f.default_factory) for f in dataclasses.fields(JobConfig)}
# Paths the run reads. In a config file a relative one is relative to the file's folder (dataset paths only
# for local kinds: for "hf" it is a dataset name).
INPUT_PATH_KEYS = ("model.hf_config", "model.tokenizer_path", "training.dataset_path", "validation.dataset_path",
                   "checkpoint.initial_load_hf")
OUTPUT_PATH_KEYS = ("job.dump_folder", "training.dataset_cache_dir")
_ALL_KEYS = [f"{s}.{k}" for s, keys in _SCHEMA.items() for k in keys]
_TRUE, _FALSE, _NONE = {"true", "1", "yes"}, {"false", "0", "no"}, {"none", "null"}


def _did_you_mean(name: str, candidates: list[str], form: str = "{}") -> str:
    match = difflib.get_close_matches(name, candidates, n=1)
    return f" (did you mean {form.format(match[0])}?)" if match else ""


def _is_optional(hint) -> bool:
    return get_origin(hint) in (Union, types.UnionType) and type(None) in get_args(hint)


def _expected(hint) -> str:
    if get_origin(hint) is Literal:
        return "one of " + "|".join(get_args(hint))
    if _is_optional(hint):
        return "a number or none"
    if get_origin(hint) is list:
        return "a list of numbers (e.g. 0.9,0.95)"
    return {bool: "a bool (true/false)", int: "an integer", float: "a number", str: "a string"}[hint]


def _coerce(value: Any, hint, from_cli: bool) -> Any:
    """`value` as `hint`, or raise ValueError. CLI values are strings to parse; TOML values must
    already have the right type (bool is not an int; an int is a valid float)."""
    if get_origin(hint) is Literal:
        if value in get_args(hint):
            return value
    elif _is_optional(hint):
        if isinstance(value, str) and value.strip().lower() in _NONE:  # TOML has no null: "none" there too
            return None
        return _coerce(value, float, from_cli)
    elif get_origin(hint) is list:
        if from_cli:
            value = [v for v in value.strip().strip("[]").split(",") if v.strip()]
        if isinstance(value, list):
            return [_coerce(v, float, from_cli) for v in value]
    elif hint is bool:
        if isinstance(value, bool):
            return value
        if from_cli and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
    elif hint is int:
        if from_cli:
            return int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if from_cli:
            return float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    raise ValueError(value)


def _set(cfg: JobConfig, section: str, key: str, value: Any, from_cli: bool, source: str) -> str | None:
    """Sets the value; returns the problem instead when it does not parse as the key's type."""
    hint = _SCHEMA[section][key]
    try:
        parsed = _coerce(value, hint, from_cli)
    except ValueError:
        return f"{source}: {section}.{key} = {value!r} is not {_expected(hint)}"
    setattr(getattr(cfg, section), key, parsed)
    return None


def _apply_file(cfg: JobConfig, path: str, problems: list[str], rejected: set[str]) -> dict[str, str]:
    """Set the file's values on `cfg`, adding what is wrong with them to `problems` (and the keys whose values were
    refused to `rejected`); returns the input paths it set, {key: value}, for `_resolve_file_paths`. A file that
    cannot be read or parsed raises: nothing of it can be checked further."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None  # tomllib names line and column
    paths = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            owners = [f"[{s}]" for s, keys in _SCHEMA.items() if section in keys]
            where = f" (it belongs under {' or '.join(owners)})" if owners else ""
            problems.append(f"{path}: top-level key {section!r} must be inside a [section]{where}")
            continue
        if section not in _SCHEMA:
            hint = _did_you_mean(section, list(_SCHEMA), "[{}]")
            problems.append(f"{path}: unknown section [{section}]{hint}")
            continue
        for key, value in table.items():
            if key not in _SCHEMA[section]:
                hint = _did_you_mean(f"{section}.{key}", _ALL_KEYS)
                problems.append(f"{path}: unknown key {section}.{key}{hint}")
            elif (problem := _set(cfg, section, key, value, from_cli=False, source=path)) is not None:
                problems.append(problem)
                rejected.add(f"{section}.{key}")
            elif f"{section}.{key}" in INPUT_PATH_KEYS:
                paths[f"{section}.{key}"] = value
    return paths


def _get(cfg: JobConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _resolve_file_paths(cfg: JobConfig, config_path: str, file_paths: dict[str, str]) -> None:
    """Relative input paths that came from the file (and were not overridden) become relative to its folder."""
    folder = os.path.dirname(os.path.abspath(config_path))
    for key, value in file_paths.items():
        section, name = key.split(".")
        is_hf_name = name == "dataset_path" and getattr(cfg, section).dataset == "hf"
        if _get(cfg, key) == value and value and not os.path.isabs(value) and not is_hf_name:
            setattr(getattr(cfg, section), name, os.path.normpath(os.path.join(folder, value)))


def _parse_argv(argv: list[str], problems: list[str],
                rejected: set[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """(config path, [(section.key, raw value)]) from `--k v` / `--k=v` pairs; what cannot be read goes to
    `problems` (a key given without a value to `rejected` too)."""
    config_path, overrides, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            problems.append(f"command line: unexpected argument {arg!r}; use --section.key value")
            continue
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i >= len(argv) or argv[i].startswith("--"):
                problems.append(f"command line: --{name} needs a value (--{name} VALUE or --{name}=VALUE)")
                rejected.add(name)
                continue
            value, i = argv[i], i + 1
        if name == "config":
            config_path = value
        elif name not in _ALL_KEYS:
            hint = _did_you_mean(name, _ALL_KEYS, "--{}")
            problems.append(f"command line: unknown option --{name}{hint}")
        else:
            overrides.append((name, value))
    return config_path, overrides


def _at_least(low):
    return lambda v: v >= low


def _positive(v) -> bool:
    return v > 0


# The values each numeric key accepts, and how its problem reads: "<key> must be <what>, got <value>". Floats are
# also checked finite (nan and inf pass no range check, and would crash torch or the run later). The parallel
# degrees and training.global_batch_size are checked against the world size (validate_parallelism);
# profiling.profile_freq only where profiling is on (_value_problems).
_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
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
}


def _finite(value) -> bool:
    values = value if isinstance(value, list) else [value]
    return all(math.isfinite(v) for v in values if isinstance(v, float))


def _value_problems(cfg: JobConfig, rejected: frozenset[str] = frozenset()) -> list[str]:
    """Values of the right type that no run can use. A check that reads a rejected key is skipped: the default
    standing in for the refused value would only mislead."""
    problems = []

    def bad(message: str, *keys: str) -> None:
        if not rejected.intersection(keys):
            problems.append(message)

    in_range = set()  # keys whose values are finite and inside their range: the checks between keys read them
    for key in _ALL_KEYS:
        value = _get(cfg, key)
        if not _finite(value):
            bad(f"{key} must be {'finite numbers' if isinstance(value, list) else 'a finite number'}, got {value}",
                key)
        elif key in _RANGES and not _RANGES[key][0](value):
            bad(f"{key} must be {_RANGES[key][1]}, got {value}", key)
        else:
            in_range.add(key)
    ratio = cfg.lr_scheduler.decay_ratio
    if ratio is not None and {"lr_scheduler.decay_ratio", "lr_scheduler.warmup_steps", "training.steps"} <= in_range:
        steps, warmup = cfg.training.steps, cfg.lr_scheduler.warmup_steps
        decay_start = steps - round(steps * ratio)
        if warmup > decay_start:  # the lr would jump from the warmup ramp into the middle of the decay
            bad(f"lr_scheduler.warmup_steps = {warmup} runs into the decay phase, which starts after step "
                f"{decay_start} (training.steps {steps} * (1 - decay_ratio {ratio})); lower warmup_steps or "
                f"decay_ratio", "lr_scheduler.warmup_steps", "lr_scheduler.decay_ratio", "training.steps")
    if (cfg.profiling.enable_profiling or cfg.profiling.enable_memory_snapshot) and cfg.profiling.profile_freq < 2:
        bad(f"profiling.profile_freq must be >= 2 (a warm-up step, then the traced one), got "
            f"{cfg.profiling.profile_freq}", "profiling.profile_freq")
    return problems


DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "train_configs" / "debug_model.toml"


def with_default_config(argv: list[str]) -> list[str]:
    """`argv`, with `--config` of the embedded default (train_configs/debug_model.toml) where it names none."""
    if any(a == "--config" or a.startswith("--config=") for a in argv):
        return argv
    return ["--config", str(DEFAULT_CONFIG), *argv]


def load_config(argv: list[str]) -> JobConfig:
    """Defaults, then the `--config` TOML file, then `--section.key` overrides; validated. A ConfigError names
    every problem found, and carries the config as far as it loaded (`ConfigError.partial`)."""
    problems: list[str] = []
    rejected: set[str] = set()
    config_path, overrides = _parse_argv(argv, problems, rejected)
    cfg = JobConfig()
    try:
        file_paths = _apply_file(cfg, config_path, problems, rejected) if config_path is not None else {}
    except ConfigError as unreadable:  # no values to check: what the command line got wrong, and the file
        raise ConfigError([*problems, *unreadable.problems]) from None
    for name, value in overrides:
        section, key = name.split(".")
        problem = _set(cfg, section, key, value, from_cli=True, source="command line")
        if problem is None:
            rejected.discard(name)  # the file's refused value is overridden (and still named)
        else:
            problems.append(problem)
            rejected.add(name)
    if config_path is not None:
        _resolve_file_paths(cfg, config_path, file_paths)
    problems += _value_problems(cfg, frozenset(rejected))
    if problems:
        raise ConfigError(problems, partial=cfg, rejected=frozenset(rejected))
    return cfg


def to_toml(cfg: JobConfig) -> str:
    """`cfg` as a TOML file that `load_config(["--config", file])` reads back to an equal config (paths made
    absolute against the current directory, so the file works from any folder)."""
    lines = []
    for section, keys in _SCHEMA.items():
        lines.append(f"[{section}]")
        for key in keys:
            value = _get(cfg, f"{section}.{key}")
            if f"{section}.{key}" in INPUT_PATH_KEYS + OUTPUT_PATH_KEYS and value:
                is_hf_name = key == "dataset_path" and getattr(cfg, section).dataset == "hf"
                value = value if is_hf_name else os.path.abspath(value)
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if value is None:
        return '"none"'  # TOML has no null; optional numbers read "none" back as None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)  # a TOML basic string: JSON's escapes are valid TOML


@dataclass(frozen=True)
class RunLayout:
    """How a run's ranks and rows are arranged: parallel degrees, global batch and gradient accumulation."""

    dims: ParallelDims
    global_batch_size: int  # rows per optimizer step over all data-parallel ranks
    grad_accum_steps: int  # micro-batches per optimizer step on each rank


def validate_parallelism(cfg: JobConfig, world_size: int) -> RunLayout:
    """The resolved layout of `cfg` on `world_size` ranks; ConfigError when it is impossible."""
    p = cfg.parallelism
    try:
        dims = ParallelDims.resolve(p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
                                    p.context_parallel_degree, p.expert_parallel_degree, world_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    local, gbs = cfg.training.local_batch_size, cfg.training.global_batch_size
    if local <= 0:
        raise ConfigError(f"training.local_batch_size must be positive, got {local}")  # as load_config says it
    per_step = local * dims.dp  # rows per micro-step over all data-parallel ranks
    if gbs == -1:
        gbs = per_step
    if gbs <= 0 or gbs % per_step:
        raise ConfigError(
            f"training.global_batch_size = {cfg.training.global_batch_size} must be -1 or a positive "
            f"multiple of local_batch_size * dp degree = {local} * {dims.dp} = {per_step}")
    return RunLayout(dims, gbs, gbs // per_step)


def exit_on_config_error(err: ConfigError) -> NoReturn:
    """What an entry point does with a ConfigError: one line on stderr, exit code 2 (usage error)."""
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
