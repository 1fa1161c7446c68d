"""What the run reads, checked before any worker starts: paths that must exist (dataset, validation set, tokenizer, HF
config and checkpoint), folders it writes that do not overlap its own outputs or another run's
(harness/run_folders.py), a known model flavor, a tokenizer that fits the model's vocabulary, chat data from a source
that holds rows and a tokenizer with a chat template, a context-parallel degree that divides the rows and the Gated
DeltaNet heads, an expert-parallel degree that divides the experts. Part of the one validation pass
(harness/config/validate.py). Runs without torch: the models' args and flavors are plain Python.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from models.qwen35_moe.args import Qwen35MoeArgs
from models.qwen35_moe.flavors import get_flavor, qwen35_moe_flavors
from models.qwen35_moe.fp8_config import quantization_config_of, quantization_problems

from ..data.chat import chat_template_problem
from ..run_folders import folder_problems
from .schema import JobConfig

_TO_SET = "set it in the config file or with --{key} PATH"


def run_requirement_problems(cfg: JobConfig, rejected: frozenset[str] = frozenset()) -> list[str]:
    """What is missing or does not fit among what the run reads (paths, flavor, tokenizer, CP and EP degrees
    against the model); checks reading a key in `rejected` are skipped."""
    def reads(*keys: str) -> bool:
        return not rejected.intersection(keys)

    problems = []
    for section in ("training", "validation") if cfg.validation.enable else ("training",):
        if reads(f"{section}.dataset_source", f"{section}.dataset_path"):
            problems += _dataset_problems(cfg, section)
    if reads("training.dataset_content", "training.dataset_source", "validation.dataset_source",
             "model.tokenizer_path"):
        problems += _chat_problems(cfg)
    if reads("checkpoint.initial_load_hf"):
        problems += _checkpoint_problems(cfg)
    if reads("metrics.enable_wandb"):
        problems += _wandb_problems(cfg)
    if reads("job.dump_folder", "checkpoint.folder", "checkpoint.enable", "metrics.save_tb_folder",
             "training.dataset_cache_dir"):
        problems += folder_problems(cfg)
    if not reads("model.hf_config", "model.flavor"):
        return problems
    args, model_problems = model_args_of(cfg)
    problems += model_problems
    if args is not None and reads("checkpoint.initial_load_hf", "model.mtp_num_hidden_layers"):
        problems += _initial_model_problems(cfg, args)
    if reads("model.tokenizer_path"):
        problems += _tokenizer_problems(cfg, args)
    if reads("parallelism.context_parallel_degree", "training.seq_len"):
        problems += _context_parallel_problems(cfg, args)
    if reads("parallelism.expert_parallel_degree"):
        problems += _expert_parallel_problems(cfg, args)
    return problems


def _context_parallel_problems(cfg: JobConfig, args: Qwen35MoeArgs | None) -> list[str]:
    cp = cfg.parallelism.context_parallel_degree
    if cp <= 1:  # below 1: the layout check names it
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
        what = "a Hugging Face dataset name" if s.dataset_source == "hf" else f"a {s.dataset_source} file or folder"
        return [f"{key} is empty; set it to {what}"]
    if s.dataset_source != "hf" and not os.path.exists(s.dataset_path):
        return [f"{key} {s.dataset_path!r} does not exist; " + _TO_SET.format(key=key)]
    return []


def _chat_problems(cfg: JobConfig) -> list[str]:
    if cfg.training.dataset_content != "chat":
        return []
    problems = [f"{section}.dataset_source = 'text' cannot hold chat data (rows with a list of messages): use jsonl, "
                f"parquet or hf with training.dataset_content = 'chat'"
                for section in (("training", "validation") if cfg.validation.enable else ("training",))
                if getattr(cfg, section).dataset_source == "text"]
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
    if not os.path.isfile(os.path.join(path, "config.json")):
        return [f"{key} {path!r} holds no config.json: a Hugging Face model folder has one (it says which model the "
                "weights are of)"]
    try:
        config = json.loads(Path(path, "config.json").read_text())
    except (OSError, ValueError) as e:
        return [f"{key} {path!r}: its config.json cannot be read: {e}"]
    quant = quantization_config_of(config) if isinstance(config, dict) else None
    if quant is not None:  # an FP8 release (models/qwen35_moe/fp8_config.py)
        return [f"{key} {path!r}: {problem}" for problem in quantization_problems(quant)]
    return []


# Fields of a model's config that do not change what it computes: token ids (the tokenizer's, written at export),
# inference switches, the init's spread (the weights are loaded), and the interval layer_types spells out.
_NOT_THE_FUNCTION = {"bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "output_router_logits",
                     "initializer_range", "full_attention_interval"}


def _initial_model_problems(cfg: JobConfig, args: Qwen35MoeArgs) -> list[str]:
    """The run's model against the config.json of the folder it starts from (checkpoint.initial_load_hf): a field
    that changes what the model computes and differs (top-k, rope_theta, rms_norm_eps, ...) would train another
    model than the one loaded, and the export's config.json would describe neither."""
    folder = cfg.checkpoint.initial_load_hf
    if not folder or not os.path.isfile(os.path.join(folder, "config.json")):
        return []  # a missing folder or file: named by _checkpoint_problems
    try:
        theirs = Qwen35MoeArgs.from_hf_config(folder)
    except (OSError, ValueError, TypeError) as e:
        return [f"checkpoint.initial_load_hf {folder!r}: its config.json: {e}"]
    skip = set(_NOT_THE_FUNCTION)
    if cfg.model.mtp_num_hidden_layers >= 0:  # the run chose its MTP layers (0: leave the folder's out)
        skip.add("mtp_num_hidden_layers")
    differ = [f"{f.name} {getattr(theirs, f.name)!r} (the run: {getattr(args, f.name)!r})"
              for f in dataclasses.fields(args) if f.name not in skip and getattr(theirs, f.name) != getattr(args, f.name)]
    if not differ:
        return []
    model = f"model.hf_config {cfg.model.hf_config!r}" if cfg.model.hf_config else f"model.flavor {cfg.model.flavor!r}"
    return [f"checkpoint.initial_load_hf {folder!r} holds another model than {model}: its config.json has "
            f"{', '.join(differ)}; train the folder's model (leave model.flavor unset, or set model.hf_config to "
            "the folder), or start from a folder of this model"]


def model_args_of(cfg: JobConfig) -> tuple[Qwen35MoeArgs | None, list[str]]:
    """The run's model: model.hf_config's or model.flavor's, with model.mtp_num_hidden_layers where it is set; or None
    and why not."""
    if cfg.model.hf_config:
        try:
            args = Qwen35MoeArgs.from_hf_config(cfg.model.hf_config)
        except (OSError, ValueError, TypeError) as e:  # missing file, bad JSON, unknown fields
            return None, [f"model.hf_config {cfg.model.hf_config!r}: {e}"]
    elif cfg.model.flavor not in qwen35_moe_flavors:
        return None, [f"model.flavor {cfg.model.flavor!r} is not a known flavor; known: "
                      f"{', '.join(qwen35_moe_flavors)} (or set model.hf_config to a config.json)"]
    else:
        args = get_flavor(cfg.model.flavor)
    if cfg.model.mtp_num_hidden_layers >= 0:
        args = dataclasses.replace(args, mtp_num_hidden_layers=cfg.model.mtp_num_hidden_layers)
    return args, []


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


def _wandb_problems(cfg: JobConfig) -> list[str]:
    """metrics.enable_wandb needs the wandb package (an optional one): the run is refused now, not at its first log.
    Imported only where the run asks for it (~0.5 s)."""
    if not cfg.metrics.enable_wandb:
        return []
    try:
        import wandb  # noqa: F401
    except ImportError:
        return ["metrics.enable_wandb is true but wandb is not installed: pip install wandb, or set it false"]
    return []
