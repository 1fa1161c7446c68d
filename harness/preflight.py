"""What a launch needs, checked before any worker starts: every problem found is named in one ConfigError.

`check_launch` is what the entry points call: the config's keys, types and values (`load_config`), the parallel
degrees on the launch's world size (`validate_parallelism`) and what the run reads (`check_run_requirements`), all
collected, none raised at the first. `check_run_requirements` alone: paths that must exist (dataset, validation set, tokenizer, HF config and checkpoint), a known model flavor,
a tokenizer that fits the model's vocabulary, chat data from a kind that holds rows and a tokenizer with a chat
template, a context-parallel degree that divides the rows and the Gated
DeltaNet heads, an expert-parallel degree that divides the experts. Runs without torch
(the models' args and flavors are plain Python), so a typo fails in well under a second.
"""

from __future__ import annotations

import os
from pathlib import Path

from models.qwen35_moe.args import Qwen35MoeArgs
from models.qwen35_moe.flavors import qwen35_moe_flavors

from .config import ConfigError, JobConfig, load_config, validate_parallelism
from .data.chat import chat_template_problem

_TO_SET = "set it in the config file or with --{key} PATH"
# What validate_parallelism reads
_LAYOUT_KEYS = frozenset({"parallelism.data_parallel_replicate_degree", "parallelism.data_parallel_shard_degree",
                          "parallelism.context_parallel_degree", "parallelism.expert_parallel_degree",
                          "training.local_batch_size", "training.global_batch_size"})


def check_launch(argv: list[str], world_size: int) -> JobConfig:
    """The config of the launch `argv` on `world_size` ranks, or one ConfigError naming every problem: a typo in one
    key does not hide a missing dataset, nor an impossible parallel degree the placeholders left to set. Checks that
    read a value the config refused are skipped (they would judge the default standing in for it)."""
    try:
        return _checked(load_config(argv), world_size, [], frozenset())
    except ConfigError as err:
        if err.partial is None:  # a config file that cannot be read: nothing further to check
            raise
        return _checked(err.partial, world_size, err.problems, err.rejected)


def _checked(cfg: JobConfig, world_size: int, problems: list[str], rejected: frozenset[str]) -> JobConfig:
    problems = list(problems)
    if not rejected & _LAYOUT_KEYS:
        try:
            validate_parallelism(cfg, world_size)
        except ConfigError as err:
            problems += [p for p in err.problems if p not in problems]  # a batch size load_config named already
    problems += run_requirement_problems(cfg, rejected)
    if problems:
        raise ConfigError(problems)
    return cfg


def check_run_requirements(cfg: JobConfig) -> None:
    problems = run_requirement_problems(cfg)
    if problems:
        raise ConfigError(problems)


def run_requirement_problems(cfg: JobConfig, rejected: frozenset[str] = frozenset()) -> list[str]:
    """What is missing or does not fit among what the run reads (paths, flavor, tokenizer, CP and EP degrees
    against the model); checks reading a key in `rejected` are skipped."""
    def reads(*keys: str) -> bool:
        return not rejected.intersection(keys)

    problems = []
    for section in ("training", "validation") if cfg.validation.enable else ("training",):
        if reads(f"{section}.dataset", f"{section}.dataset_path"):
            problems += _dataset_problems(cfg, section)
    if reads("training.data_format", "training.dataset", "validation.dataset", "model.tokenizer_path"):
        problems += _chat_problems(cfg)
    if reads("checkpoint.initial_load_hf"):
        problems += _checkpoint_problems(cfg)
    if not reads("model.hf_config", "model.flavor"):
        return problems
    args, model_problems = _model_args(cfg)
    problems += model_problems
    if reads("model.tokenizer_path"):
        problems += _tokenizer_problems(cfg, args)
    if reads("parallelism.context_parallel_degree", "training.seq_len"):
        problems += _context_parallel_problems(cfg, args)
    if reads("parallelism.expert_parallel_degree"):
        problems += _expert_parallel_problems(cfg, args)
    return problems


def _context_parallel_problems(cfg: JobConfig, args: Qwen35MoeArgs | None) -> list[str]:
    cp = cfg.parallelism.context_parallel_degree
    if cp <= 1:  # below 1: validate_parallelism names it
        return []
    problems = []
    if cfg.training.seq_len % (2 * cp):
        problems.append(f"training.seq_len = {cfg.training.seq_len} must be divisible by 2 * "
                        f"parallelism.context_parallel_degree = {2 * cp} (each rank holds 2 chunks of every row)")
    if args is not None and (args.linear_num_key_heads % cp or args.linear_num_value_heads % cp):
        problems.append(f"parallelism.context_parallel_degree = {cp} must divide the Gated DeltaNet key and value "
                        f"head counts ({args.linear_num_key_heads} and {args.linear_num_value_heads}): each rank "
                        f"runs the recurrence for its share of the heads")
    return problems


def _expert_parallel_problems(cfg: JobConfig, args: Qwen35MoeArgs | None) -> list[str]:
    ep = cfg.parallelism.expert_parallel_degree
    if ep <= 1 or args is None or args.num_experts % ep == 0:
        return []
    return [f"parallelism.expert_parallel_degree = {ep} must divide the number of experts ({args.num_experts}): "
            f"each rank holds an equal share of every MoE layer's experts"]


def _dataset_problems(cfg: JobConfig, section: str) -> list[str]:
    s = getattr(cfg, section)
    key = f"{section}.dataset_path"
    if not s.dataset_path:
        what = "a Hugging Face dataset name" if s.dataset == "hf" else f"a {s.dataset} file or folder"
        return [f"{key} is empty; set it to {what}"]
    if s.dataset != "hf" and not os.path.exists(s.dataset_path):
        return [f"{key} {s.dataset_path!r} does not exist; " + _TO_SET.format(key=key)]
    return []


def _chat_problems(cfg: JobConfig) -> list[str]:
    if cfg.training.data_format != "chat":
        return []
    problems = [f"{section}.dataset = 'text' cannot hold chat data (rows with a list of messages): use jsonl, parquet "
                f"or hf with training.data_format = 'chat'"
                for section in (("training", "validation") if cfg.validation.enable else ("training",))
                if getattr(cfg, section).dataset == "text"]
    path = cfg.model.tokenizer_path
    if not path or os.path.exists(path):  # a missing path is named by the tokenizer's own check
        problem = chat_template_problem(path)
        problems += [problem] if problem else []
    return problems


def _checkpoint_problems(cfg: JobConfig) -> list[str]:
    path, key = cfg.checkpoint.initial_load_hf, "checkpoint.initial_load_hf"
    if not path:
        return []
    if not os.path.isdir(path):
        return [f"{key} {path!r} is not a folder; " + _TO_SET.format(key=key)]
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", "model.safetensors.index.json")):
        return [f"{key} {path!r} holds no model.safetensors or model.safetensors.index.json"]
    return []


def _model_args(cfg: JobConfig) -> tuple[Qwen35MoeArgs | None, list[str]]:
    if cfg.model.hf_config:
        try:
            return Qwen35MoeArgs.from_hf_config(cfg.model.hf_config), []
        except (OSError, ValueError, TypeError) as e:  # missing file, bad JSON, unknown fields
            return None, [f"model.hf_config {cfg.model.hf_config!r}: {e}"]
    if cfg.model.flavor not in qwen35_moe_flavors:
        return None, [f"model.flavor {cfg.model.flavor!r} is not a known flavor; known: "
                      f"{', '.join(qwen35_moe_flavors)} (or set model.hf_config to a config.json)"]
    return qwen35_moe_flavors[cfg.model.flavor], []


def _tokenizer_problems(cfg: JobConfig, args: Qwen35MoeArgs | None) -> list[str]:
    path, key = cfg.model.tokenizer_path, "model.tokenizer_path"
    if not path:
        vocab = 258  # the built-in byte tokenizer
    else:
        file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
        if not os.path.exists(path):
            return [f"{key} {path!r} does not exist; " + _TO_SET.format(key=key)]
        if not file.is_file():
            return [f"{key} {path!r} holds no tokenizer.json (a Hugging Face tokenizer folder, or the "
                    "tokenizer.json file itself; empty = the built-in byte tokenizer)"]
        try:
            vocab = _vocab_size(file)
        except ValueError as e:
            return [f"{key}: {file} is not a tokenizer.json ({e})"]
    if args is not None and vocab > args.vocab_size:
        return [f"the tokenizer has {vocab} tokens but the model's vocab_size is {args.vocab_size}; pick a "
                f"matching tokenizer (model.tokenizer_path) or model (model.flavor / model.hf_config)"]
    return []


def _vocab_size(tokenizer_json: Path) -> int:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # tokenizers raises its own exception type for unreadable files
        raise ValueError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
