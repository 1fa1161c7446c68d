"""`--help`: every config section and key with its type, default and the comment it has in harness/config.py.

The comments are read from the source of the section dataclasses, so the help cannot drift from them.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Literal, get_args, get_origin

from . import config

USAGE = """usage: ./run_train.sh [--config FILE] [--section.key VALUE ...]   (or python -m harness.train ...)

Trains Qwen3.5-MoE as FILE describes (default: train_configs/debug_model.toml); any key below can be set in
FILE or on the command line (--key VALUE or --key=VALUE; lists as 0.9,0.95; "none" for optional numbers).
Relative input paths in FILE are relative to FILE's folder; on the command line and for outputs, to the
current directory. Exit codes: 0 done, 2 bad input (one `error:` line), 3 diverged (NaN / inf loss).
Environment (run_train.sh): NGPU, NNODES, RDZV_ENDPOINT, RDZV_ID, LOG_RANK, PYTHON.
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
        return "list of floats"
    return hint.__name__


def _shown(default) -> str:
    if isinstance(default, bool):
        return "true" if default else "false"
    if default is None:
        return "none"
    return '""' if default == "" else str(default)


def config_help() -> str:
    lines = [USAGE]
    for section in dataclasses.fields(config.JobConfig):
        cls = section.default_factory
        defaults, comments = cls(), _comments(cls)
        lines.append(f"[{section.name}]")
        for key, hint in config._SCHEMA[section.name].items():
            default = getattr(defaults, key)
            lines.append(f"  --{section.name}.{key}  ({_type_name(hint)}, default {_shown(default)})")
            if comments.get(key):
                lines.append(f"      {comments[key]}")
        lines.append("")
    return "\n".join(lines)
