"""What a run needs, checked before any worker starts: every problem found is named in one ConfigError.

Paths that must exist (dataset, validation set, tokenizer, HF config and checkpoint), a known model flavor,
a tokenizer that fits the model's vocabulary, a context-parallel degree that divides the rows and the Gated
DeltaNet heads, an expert-parallel degree that divides the experts. Runs without torch
(the models' args and flavors are plain Python), so a typo fails in well under a second.
"""

from __future__ import annotations

import os
from pathlib import Path

from models.qwen35_moe.args import Qwen35MoeArgs
from models.qwen35_moe.flavors import qwen35_moe_flavors

from .config import ConfigError, JobConfig

_TO_SET = "set it in the config file or with --{key} PATH"


def check_run_requirements(cfg: JobConfig) -> None:
    problems = _dataset_problems(cfg, "training") + _checkpoint_problems(cfg)
    if cfg.validation.enable:
        problems += _dataset_problems(cfg, "validation")
    args, model_problems = _model_args(cfg)
    problems += model_problems + _tokenizer_problems(cfg, args) + _context_parallel_problems(cfg, args)
    problems += _expert_parallel_problems(cfg, args)
    if problems:
        head = "the run cannot start: " if len(problems) > 1 else ""
        raise ConfigError(head + "; ".join(problems))


def _context_parallel_problems(cfg: JobConfig, args: Qwen35MoeArgs | None) -> list[str]:
    cp = cfg.parallelism.context_parallel_degree
    if cp == 1:
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
    if ep == 1 or args is None or args.num_experts % ep == 0:
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
