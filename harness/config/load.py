"""A run's config from defaults, then the `--config` TOML file, then `--section.key value` overrides; and back to TOML.

Loading names every problem it finds at once (unknown keys, wrong types, bad values), not the first one.
`load_config` checks the values; `check_launch`, what the entry points call, also the parallel layout on the launch's
world size and what the run reads (harness/config/validate.py: one pass). An old key or value
(harness/config/renamed.py) is read as its new one, with one notice line once the config loads.

Relative paths: the input paths of INPUT_PATH_KEYS written in a config file are relative to that file's folder
(a config travels with its data); on the command line, and for outputs (job.dump_folder,
training.dataset_cache_dir), they are relative to the current directory. `to_toml` writes a loaded config back,
every path absolute, so `--config <dump_folder>/config.toml` repeats a run from anywhere.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import tomllib
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from .errors import ConfigError
from .renamed import RENAMED_KEYS, RETIRED_KEYS, current_value, print_notices, renamed_key_notice, retired_key_notice
from .schema import ALL_KEYS, INPUT_PATH_KEYS, OUTPUT_PATH_KEYS, SCHEMA, JobConfig, get_value, names_a_dataset
from .validate import config_problems

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "train_configs" / "debug_model.toml"
_TRUE, _FALSE, _NONE = {"true", "1", "yes"}, {"false", "0", "no"}, {"none", "null"}
COMMAND_LINE = "command line"


@dataclass
class ParsedConfig:
    """What the file and the command line set, before any value is judged."""

    cfg: JobConfig = field(default_factory=JobConfig)
    problems: list[str] = field(default_factory=list)  # what could not be read or parsed
    rejected: set[str] = field(default_factory=set)  # keys whose given values were refused
    notices: list[str] = field(default_factory=list)  # old names read as their new ones
    given: set[str] = field(default_factory=set)  # keys the file or the command line set (under any name)


def with_default_config(argv: list[str]) -> list[str]:
    """`argv`, with `--config` of the embedded default (train_configs/debug_model.toml) where it names none."""
    if any(a == "--config" or a.startswith("--config=") for a in argv):
        return argv
    return ["--config", str(DEFAULT_CONFIG), *argv]


def load_config(argv: list[str]) -> JobConfig:
    """Defaults, then the `--config` TOML file, then `--section.key` overrides; the values checked. A ConfigError
    names every problem found, and carries the config as far as it loaded (`ConfigError.partial`)."""
    parsed = parse_config(argv)
    return _checked(parsed, config_problems(parsed.cfg, rejected=frozenset(parsed.rejected)))


def check_launch(argv: list[str], world_size: int) -> JobConfig:
    """The config of the launch `argv` on `world_size` ranks, or one ConfigError naming every problem: a typo in one
    key does not hide a missing dataset, nor an impossible parallel degree the placeholders left to set."""
    parsed = parse_config(argv)
    return _checked(parsed, config_problems(parsed.cfg, world_size, frozenset(parsed.rejected), run_requirements=True))


def _checked(parsed: ParsedConfig, validation_problems: list[str]) -> JobConfig:
    """The parsed config, its notices printed, or a ConfigError naming what parsing and validation found."""
    problems = parsed.problems + validation_problems
    if problems:
        raise ConfigError(problems, partial=parsed.cfg, rejected=frozenset(parsed.rejected))
    print_notices(parsed.notices)
    return parsed.cfg


def parse_config(argv: list[str]) -> ParsedConfig:
    """The config `argv` sets, with what could not be read or parsed; a ConfigError only when the config file
    itself cannot be read (nothing of it to check further: its problem beside the command line's)."""
    parsed = ParsedConfig()
    config_path, overrides = _parse_argv(argv, parsed)
    try:
        file_paths = _apply_file(config_path, parsed) if config_path is not None else {}
    except ConfigError as unreadable:
        for key, value, given_as in overrides:  # each command-line value is still read as its key's type
            _set(parsed, key, value, from_cli=True, source=COMMAND_LINE, given_as=given_as)
        raise ConfigError([*parsed.problems, *unreadable.problems]) from None
    for key, value, given_as in overrides:
        if _set(parsed, key, value, from_cli=True, source=COMMAND_LINE, given_as=given_as):
            parsed.rejected.discard(key)  # the file's refused value is overridden (and still named)
        else:
            parsed.rejected.add(key)
    if config_path is not None:
        _resolve_file_paths(parsed.cfg, config_path, file_paths)
    _model_from_initial_checkpoint(parsed)
    return parsed


def _model_from_initial_checkpoint(parsed: ParsedConfig) -> None:
    """A run that starts from an HF folder (checkpoint.initial_load_hf) and names no model (neither model.flavor nor
    model.hf_config set) trains the folder's own model: its config.json becomes model.hf_config, as a user starting
    from a release expects (a named model is compared with the folder's instead: run_requirements.py)."""
    cfg = parsed.cfg
    folder = cfg.checkpoint.initial_load_hf
    if folder and not parsed.given & {"model.flavor", "model.hf_config"} and \
            os.path.isfile(os.path.join(folder, "config.json")):
        cfg.model.hf_config = os.path.join(folder, "config.json")
        parsed.notices.append(f"notice: the model is {cfg.model.hf_config}, the config of checkpoint.initial_load_hf "
                              "(no model.flavor or model.hf_config given)")


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
        return "a list of names (e.g. q_proj,experts)" if get_args(hint)[0] is str else \
            "a list of numbers (e.g. 0.9,0.95)"
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
        if from_cli:  # q_proj,experts; also as TOML writes it, ["q_proj", "experts"] (no name holds a quote)
            value = [v.strip().strip("'\"").strip() for v in value.strip().strip("[]").split(",")]
            value = [v for v in value if v]
        if isinstance(value, list):
            return [_coerce(v, get_args(hint)[0], from_cli) for v in value]
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


def _set(parsed: ParsedConfig, key: str, value: Any, from_cli: bool, source: str, given_as: str) -> bool:
    """Sets `key` (written `given_as`: its old name, if so) to the value; False, with the problem added, when the
    value does not parse as the key's type."""
    section, name = key.split(".")
    hint = SCHEMA[section][name]
    value = current_value(key, value, source, parsed.notices)
    try:
        coerced = _coerce(value, hint, from_cli)
    except ValueError:
        parsed.problems.append(f"{source}: {given_as} = {value!r} is not {_expected(hint)}")
        return False
    setattr(getattr(parsed.cfg, section), name, coerced)
    parsed.given.add(key)
    return True


def _current_name(name: str, source: str, parsed: ParsedConfig) -> str | None:
    """The key `name` (a known section.key, or an old one) is read as, with a notice for an old one; None for a key
    no longer read."""
    if name in RETIRED_KEYS:
        parsed.notices.append(retired_key_notice(source, name))
        return None
    if name in RENAMED_KEYS:
        parsed.notices.append(renamed_key_notice(source, name))
        return RENAMED_KEYS[name]
    return name


def _apply_file(path: str, parsed: ParsedConfig) -> dict[str, str]:
    """Set the file's values, adding what is wrong with them to `parsed`; returns the input paths it set,
    {key: value}, for `_resolve_file_paths`. A file that cannot be read or parsed raises."""
    paths: dict[str, str] = {}
    given: dict[str, str] = {}  # key -> the name the file wrote it under
    for section, table in _read_toml(path).items():
        if (problem := _section_problem(path, section, table)) is not None:
            parsed.problems.append(problem)
            continue
        for name, value in table.items():
            key = _file_key(path, f"{section}.{name}", given, parsed)
            if key is None:
                continue
            if not _set(parsed, key, value, from_cli=False, source=path, given_as=given[key]):
                parsed.rejected.add(key)
            elif key in INPUT_PATH_KEYS:
                paths[key] = value
    return paths


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None  # tomllib names line and column


def _section_problem(path: str, section: str, table) -> str | None:
    if not isinstance(table, dict):
        owners = [f"[{s}]" for s, keys in SCHEMA.items() if section in keys]
        where = f" (it belongs under {' or '.join(owners)})" if owners else ""
        return f"{path}: top-level key {section!r} must be inside a [section]{where}"
    if section not in SCHEMA:
        return f"{path}: unknown section [{section}]{_did_you_mean(section, list(SCHEMA), '[{}]')}"
    return None


def _file_key(path: str, written: str, given: dict[str, str], parsed: ParsedConfig) -> str | None:
    """The key the file's `written` section.key sets (recorded in `given`), or None where it sets none: an unknown
    key, one no longer read, or one the file already set under its other name (each a problem or a notice)."""
    if written not in ALL_KEYS and written not in RENAMED_KEYS and written not in RETIRED_KEYS:
        parsed.problems.append(f"{path}: unknown key {written}{_did_you_mean(written, ALL_KEYS)}")
        return None
    key = _current_name(written, path, parsed)
    if key is not None and key in given:  # an old name beside its new one: which one the file means is not clear
        parsed.problems.append(f"{path}: {given[key]} and {written} are one key, {key}; keep {key} alone")
        parsed.rejected.add(key)
        return None
    if key is not None:
        given[key] = written
    return key


def _resolve_file_paths(cfg: JobConfig, config_path: str, file_paths: dict[str, str]) -> None:
    """Relative input paths that came from the file (and were not overridden) become relative to its folder."""
    folder = os.path.dirname(os.path.abspath(config_path))
    for key, value in file_paths.items():
        section, name = key.split(".")
        if get_value(cfg, key) == value and value and not os.path.isabs(value) and not names_a_dataset(cfg, key):
            setattr(getattr(cfg, section), name, os.path.normpath(os.path.join(folder, value)))


def _parse_argv(argv: list[str], parsed: ParsedConfig) -> tuple[str | None, list[tuple[str, str, str]]]:
    """(config path, [(section.key, raw value, the name it was given as)]) from `--k v` / `--k=v` pairs; what cannot
    be read goes to `parsed.problems` (a key given without a value to `parsed.rejected` too)."""
    config_path, overrides, i = None, [], 0
    conflicted: set[str] = set()  # keys given under an old and a new name
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            parsed.problems.append(f"command line: unexpected argument {arg!r}; use --section.key value")
            continue
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i >= len(argv) or argv[i].startswith("--"):
                parsed.problems.append(f"command line: --{name} needs a value (--{name} VALUE or --{name}=VALUE)")
                parsed.rejected.add(RENAMED_KEYS.get(name, name))
                continue
            value, i = argv[i], i + 1
        if name == "config":
            config_path = value
        elif name not in ALL_KEYS and name not in RENAMED_KEYS and name not in RETIRED_KEYS:
            hint = _did_you_mean(name, ALL_KEYS, "--{}")
            parsed.problems.append(f"command line: unknown option --{name}{hint}")
        elif (key := _current_name(name, COMMAND_LINE, parsed)) is not None:
            other = next((given for k, _, given in overrides if k == key and given != name), None)
            if other is not None and key not in conflicted:  # an old name beside its new one: which is meant?
                parsed.problems.append(f"command line: --{other} and --{name} are one key, {key}; keep --{key} alone")
                conflicted.add(key)
            if key not in conflicted:
                overrides.append((key, value, name))
    parsed.rejected.update(conflicted)
    overrides = [o for o in overrides if o[0] not in conflicted]
    return config_path, overrides


def with_absolute_paths(cfg: JobConfig) -> JobConfig:
    """A copy of `cfg` with every path absolute against the current directory (a Hugging Face dataset name left as
    it is): what a saved config.toml and a checkpoint's run config hold, so that they mean the same from any folder."""
    cfg = copy.deepcopy(cfg)
    for name in INPUT_PATH_KEYS + OUTPUT_PATH_KEYS:
        value = get_value(cfg, name)
        if value and not names_a_dataset(cfg, name):
            section, key = name.split(".")
            setattr(getattr(cfg, section), key, os.path.abspath(value))
    return cfg


def to_toml(cfg: JobConfig) -> str:
    """`cfg` as a TOML file that `load_config(["--config", file])` reads back to an equal config (paths made
    absolute against the current directory, so the file works from any folder)."""
    cfg, lines = with_absolute_paths(cfg), []
    for section, keys in SCHEMA.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(get_value(cfg, f'{section}.{key}'))}" for key in keys]
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
