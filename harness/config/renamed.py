"""Keys and values that once had other names: a config file or command line that still uses an old one runs as
before, with one notice line naming the new key (or saying the key is no longer read); a checkpoint's saved run
config is read under the new names (`with_current_names`), so a relaunch compares like with like
(harness/config/resume.py).
"""

from __future__ import annotations

import os
import sys

# old section.key -> the key that replaces it
RENAMED_KEYS = {
    # "dataset" held where the documents come from, not a dataset; "data_format" what a row holds
    "training.dataset": "training.dataset_source",
    "validation.dataset": "validation.dataset_source",
    "training.data_format": "training.dataset_content",
    # a benchmark switch, not part of the model: torchtitan's name and section
    "model.router_force_balance": "debug.moe_force_load_balance",
}
# section.key -> why it is no longer read (its value is ignored)
RETIRED_KEYS = {
    "model.name": "this harness trains one model family; model.flavor or model.hf_config pick its shape",
}
# (section.key, old value) -> the value that replaces it
RENAMED_VALUES = {
    ("parallelism.fsdp_reshard_after_forward", "default"): "always",  # torchtitan's two names of one behaviour
}

_shown: set[str] = set()  # the notices this process has printed


def renamed_key_notice(source: str, old: str) -> str:
    return f"notice: {source}: {old} is now {RENAMED_KEYS[old]} (the old name still works; rename it)"


def retired_key_notice(source: str, key: str) -> str:
    return f"notice: {source}: {key} is no longer read ({RETIRED_KEYS[key]}); remove it"


def renamed_value(key: str, value):
    """The value that replaces `value` of `key`, or None where it was not renamed."""
    return RENAMED_VALUES.get((key, value)) if isinstance(value, str) else None


def current_value(key: str, value, source: str, notices: list[str]):
    """`value` of `key`, an old value replaced by its new one (and a notice for it added to `notices`)."""
    new = renamed_value(key, value)
    if new is None:
        return value
    notices.append(f"notice: {source}: {key} = {value!r} is now {new!r}, the same behaviour (the old value still "
                   f"works; change it)")
    return new


def with_current_names(config: dict[str, dict]) -> dict[str, dict]:
    """A run config as `JobConfig.to_dict()` gives it, saved by any version, under today's keys and values: renamed
    keys moved to their new names (a new name saved beside its old one wins), retired keys dropped."""
    current: dict[str, dict] = {}
    for section, keys in config.items():
        for key, value in keys.items():
            name = f"{section}.{key}"
            if name in RETIRED_KEYS:
                continue
            new_section, new_key = RENAMED_KEYS.get(name, name).split(".")
            if name in RENAMED_KEYS and new_key in config.get(new_section, {}):
                continue
            new_value = renamed_value(f"{new_section}.{new_key}", value)
            current.setdefault(new_section, {})[new_key] = value if new_value is None else new_value
    return current


def print_notices(notices: list[str]) -> None:
    """Each notice once per process, on stderr, from rank 0 alone (every rank reads the same config). Workers of
    the launcher (harness/launch.py, which sets QWEN35_EXIT_DIR for them) print none: it printed them already."""
    if os.environ.get("RANK", "0") != "0" or "QWEN35_EXIT_DIR" in os.environ:
        return
    for line in notices:
        if line not in _shown:
            _shown.add(line)
            print(line, file=sys.stderr, flush=True)
