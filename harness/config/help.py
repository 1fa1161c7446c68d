"""`--help`: every config section and key with its type, its value in the run the command line describes (the
config file, default train_configs/debug_model.toml, and the overrides before `--help`), the built-in default
where that differs, and the comment it has in harness/config/schema.py; then the old names still read.

The comments are read from the source of the section dataclasses, so the help cannot drift from them.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Literal, get_args, get_origin

from .errors import ConfigError
from .load import load_config, with_default_config
from .renamed import RENAMED_KEYS, RENAMED_VALUES, RETIRED_KEYS
from .schema import SCHEMA, JobConfig

USAGE = """usage: ./run_train.sh [--config FILE] [--section.key VALUE ...]

Trains Qwen3.5-MoE as FILE describes (default: train_configs/debug_model.toml); any key below can be set in
FILE or on the command line (--key VALUE or --key=VALUE; lists as 0.9,0.95 or q_proj,experts; "none" for optional numbers).
Relative input paths in FILE are relative to FILE's folder; on the command line and for outputs, to the
current directory. Exit codes: 0 done (or stopped by SIGTERM, saved), 2 bad input (one `error:` line),
3 diverged (NaN / inf loss), 130 Ctrl-C, 143 SIGTERM before the first step. Environment: NGPU, NNODES, RDZV_ENDPOINT, RDZV_ID, LOG_RANK, PYTHON.
"""

_FIELD = re.compile(r"^\s{4}(\w+)\s*:")


def _comments(cls) -> dict[str, str]:
    """{field: comment} from `cls`'s source: comment lines just above a field and a comment after it."""
    found, pending = {}, []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("# "))
            continue
        match = _FIELD.match(line)
        if match:
            trailing = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            found[match.group(1)] = " ".join(pending + [trailing]).strip()
        pending = []
    return found


def _type_name(hint) -> str:
    if get_origin(hint) is Literal:
        return "|".join(get_args(hint))
    if type(None) in get_args(hint):
        return "float or none"
    if get_origin(hint) is list:
        return "list of names" if get_args(hint)[0] is str else "list of numbers"
    return hint.__name__


def _shown(default) -> str:
    if isinstance(default, bool):
        return "true" if default else "false"
    if default is None:
        return "none"
    if isinstance(default, list):  # as the command line takes it
        return ",".join(map(str, default))
    return '""' if default == "" else str(default)


def config_help(argv: list[str]) -> str:
    """The help for the run `argv` (its `--help` left out) describes."""
    argv = with_default_config([a for a in argv if a not in ("-h", "--help")])
    try:
        run = load_config(argv)
        source = (f"Values are this run's ({_config_file(argv)} and the command line),\nwith the built-in "
                  f"default where it differs.")
    except ConfigError as err:  # the keys still help; the run's values cannot be shown
        run, source = JobConfig(), f"Values are the built-in defaults: the run's config could not be read: {err}"
    lines = [USAGE, source, ""]
    builtin = JobConfig()
    for section in dataclasses.fields(JobConfig):
        comments = _comments(section.default_factory)
        lines.append(f"[{section.name}]")
        for key, hint in SCHEMA[section.name].items():
            value, default = getattr(getattr(run, section.name), key), getattr(getattr(builtin, section.name), key)
            shown = _shown(value) + ("" if value == default else f", built-in {_shown(default)}")
            lines.append(f"  --{section.name}.{key}  ({_type_name(hint)}, {shown})")
            if comments.get(key):
                lines.append(f"      {comments[key]}")
        lines.append("")
    return "\n".join(lines + _old_names())


def _old_names() -> list[str]:
    """The keys and values read under their new names, each with a notice, and the keys no longer read."""
    lines = ["Old names, still read (each with a notice line):"]
    lines += [f"  --{old}  now --{new}" for old, new in RENAMED_KEYS.items()]
    lines += [f"  --{key} {old}  now {new}" for (key, old), new in RENAMED_VALUES.items()]
    lines += [f"  --{key}  no longer read: {why}" for key, why in RETIRED_KEYS.items()]
    return lines + [""]


def _config_file(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return "no config file"
