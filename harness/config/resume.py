"""A resumed run runs with the relaunch's config: what the relaunch changes applies on top of the loaded state.

Loading a checkpoint restores the optimizer's parameter groups (lr, betas, eps, weight decay, Adam vs AdamW) and
the schedule's peak lr as they were saved; harness/optim/relaunch.py then sets the relaunch's values on them, so
that `--optimizer.lr 1e-5` after a loss spike lowers the lr, as `config.toml` says it does. The schedule's shape
(warmup, decay, training.steps) is the relaunch's already: it is built from the config, and the checkpoint holds
only its step count. Each change is one log line.

What cannot apply is the data position when the data changed: rows of another dataset, tokenizer or `seq_len`
would not continue where the saved position points. `data_changes` names those differences (the loader checks
the data's content too); `checkpoint.restart_data` resumes weights, optimizer and schedule and reads the data
from its start instead.

A checkpoint's run config is read under today's names (harness/config/renamed.py): one saved before a key was
renamed compares like with like.
"""

from __future__ import annotations

import math
import os

from ..optim.lr_schedule import lr_factor
from .renamed import with_current_names
from .schema import INPUT_PATH_KEYS, OUTPUT_PATH_KEYS, JobConfig

# What the saved data position refers to (keys of JobConfig.to_dict()).
DATA_KEYS = ("training.dataset_source", "training.dataset_path", "training.dataset_text_field", "training.seq_len",
             "model.tokenizer_path", "training.dataset_content", "training.chat_messages_field",
             "training.chat_targets", "training.chat_overlong")
SCHEDULE_KEYS = ("training.steps", "lr_scheduler.warmup_steps", "lr_scheduler.decay_ratio",
                 "lr_scheduler.decay_type", "lr_scheduler.min_lr_factor")
# Read afresh at every launch, or not about the training itself: never worth a line.
_QUIET_KEYS = ("checkpoint.load_step", "checkpoint.restart_data", "job.description")


def _flat(config: dict) -> dict:
    """{section.key: value} of a run config, under today's names."""
    return {f"{section}.{key}": value for section, keys in with_current_names(config).items()
            for key, value in keys.items()}


def _same(key: str, saved, now, source: str) -> bool:
    is_path = key in INPUT_PATH_KEYS + OUTPUT_PATH_KEYS and not (key == "training.dataset_path" and source == "hf")
    if is_path and saved and now:
        return os.path.realpath(saved) == os.path.realpath(now)  # the same file, named from another folder
    return saved == now


def data_changes(saved_config: dict | None, run_config: dict) -> list[str]:
    """`key saved -> now` for each DATA_KEYS value that differs between a checkpoint's run config and this run's
    (`JobConfig.to_dict()` both; [] for a checkpoint saved without its config)."""
    if saved_config is None:
        return []
    saved, now = _flat(saved_config), _flat(run_config)
    source = now.get("training.dataset_source", "")
    return [f"{key} {saved[key]!r} -> {now[key]!r}" for key in DATA_KEYS
            if key in saved and key in now and not _same(key, saved[key], now[key], source)]


def other_changes(saved_config: dict | None, cfg: JobConfig, step: int = 0) -> list[str]:
    """`key saved -> now` for every other key the relaunch changed (the optimizer's are reported where applied; a
    path named otherwise but leading to the same place is no change), and, where the LR schedule changed, the lr
    of the next step (`step` + 1) under the saved schedule and under this one."""
    if saved_config is None:
        return []
    saved, now = _flat(saved_config), _flat(cfg.to_dict())
    skip = set(DATA_KEYS) | set(_QUIET_KEYS) | {k for k in now if k.startswith("optimizer.")}
    source = now.get("training.dataset_source", "")
    changes = [f"{key} {saved[key]!r} -> {now[key]!r}" for key in now
               if key in saved and key not in skip and not _same(key, saved[key], now[key], source)]
    return changes + _schedule_change(saved, now, step)


def _schedule_change(saved: dict, now: dict, step: int) -> list[str]:
    """The lr the next step runs at under the saved schedule and under the relaunch's, where they differ: a longer
    training.steps stretches a decay already under way (the lr rises back), which the key's line alone hides."""
    keys = (*SCHEDULE_KEYS, "optimizer.lr")
    if any(key not in saved for key in keys) or all(saved[key] == now[key] for key in keys):
        return []

    def lr(config: dict) -> float:
        factor = lr_factor(step + 1, *(config[key] for key in SCHEDULE_KEYS))
        return config["optimizer.lr"] * factor

    before, after = lr(saved), lr(now)
    if math.isclose(before, after, rel_tol=1e-9):
        return []
    way = "up" if after > before else "down"
    return [f"the LR schedule is this launch's: step {step + 1} runs at lr {after:.3g}, {way} from {before:.3g} "
            "under the checkpoint's"]
