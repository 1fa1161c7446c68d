"""The `quantization_config` of an official FP8 release's config.json, checked field by field (torch-free: the
launcher's config check reads it before any worker starts).

What is read: quant_method "fp8", fmt "e4m3" (float8_e4m3fn weights), activation_scheme "dynamic" (no activation
scales stored: training computes activations in bf16 anyway), weight_block_size [128, 128] (fp8_blocks.BLOCK),
modules_to_not_convert (the modules kept unquantized: a tensor under one of them must not be float8), and the two
fields transformers' fine-grained FP8 config may add, scale_fmt "float" (not UE8M0 power-of-two scales) and
dequantize false. Anything else is named as unsupported.
"""

from __future__ import annotations

import functools
import itertools
import json
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> its block scales "X.weight_scale_inv"
_REQUIRED = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
_OPTIONAL = {"scale_fmt": ("float", None), "dequantize": (False, None)}


def quantization_config_of(config: dict[str, Any]) -> dict[str, Any] | None:
    """A config.json's quantization_config (top level, or inside text_config), None without one."""
    found = config.get("quantization_config")
    if found is None and isinstance(config.get("text_config"), dict):
        found = config["text_config"].get("quantization_config")
    return found


def folder_quantization_config(folder: str | Path) -> dict[str, Any] | None:
    """The quantization_config of HF folder `folder`'s config.json; None without one, or without a config.json.
    OSError / ValueError where the config.json cannot be read."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    return quantization_config_of(config) if isinstance(config, dict) else None


def quantization_problems(quant: Any) -> list[str]:
    """Every way `quant` (a quantization_config) is not the FP8 release layout this project reads; [] if it is."""
    if not isinstance(quant, dict):
        return [f"quantization_config is a JSON {type(quant).__name__}, not an object"]
    problems = []
    for field, wanted in _REQUIRED.items():
        if field not in quant:
            problems.append(f"quantization_config.{field} is missing (the FP8 release has {wanted!r})")
        elif quant[field] != wanted:
            problems.append(f"quantization_config.{field} {quant[field]!r} is not supported (only {wanted!r})")
    for field, allowed in _OPTIONAL.items():
        if field in quant and quant[field] not in allowed:
            problems.append(f"quantization_config.{field} {quant[field]!r} is not supported (only {allowed[0]!r})")
    modules = quant.get("modules_to_not_convert", [])
    if modules is not None and not (isinstance(modules, list) and all(isinstance(m, str) for m in modules)):
        problems.append("quantization_config.modules_to_not_convert is not a list of module names")
    unknown = sorted(set(quant) - set(_REQUIRED) - set(_OPTIONAL) - {"modules_to_not_convert"})
    if unknown:
        problems.append(f"quantization_config has fields this project does not read: {', '.join(unknown)}")
    return problems


def kept_unquantized(key: str, modules: list[str] | None) -> bool:
    """Whether tensor `key` lies under one of `modules` (modules_to_not_convert: module names, `*` a wildcard):
    fnmatchcase(key, m) or fnmatchcase(key, m + ".*"). A name without wildcards is looked up among the key's
    dot-separated prefixes instead (the release lists 146 modules and quantizes 31k weights: matching every pair
    took seconds of each load)."""
    names, patterns = _names_and_patterns(tuple(modules or ()))
    prefixes = itertools.accumulate(key.split("."), lambda head, part: f"{head}.{part}")
    return not names.isdisjoint(prefixes) or any(fnmatchcase(key, m) or fnmatchcase(key, m + ".*") for m in patterns)


@functools.lru_cache(maxsize=8)
def _names_and_patterns(modules: tuple[str, ...]) -> tuple[frozenset[str], tuple[str, ...]]:
    """modules_to_not_convert split into plain module names and those with fnmatch's wildcards (*, ?, [)."""
    names = frozenset(m for m in modules if not set("*?[") & set(m))
    return names, tuple(m for m in modules if m not in names)
