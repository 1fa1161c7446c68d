"""Dump the kernel configs FLA's autotuner chose in this process, in FLA's own config-cache format, so that a later
process (a fresh GPU machine) can run those kernels without autotuning them: `FLA_CACHE_MODE=fuzzy
FLA_CONFIG_DIR=<folder>` set before FLA is imported (tests/gpu/conftest.py does so for this suite)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch


def _config_entry(config) -> dict:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None)}


def dump_fla_configs(folder: Path) -> list[str]:
    """Write the config every live FLA autotuner chose, per kernel and autotune key, as FLA's config cache
    reads them (`fla.ops.utils.cache.load_cached_config`). Returns the kernels written."""
    import triton
    from fla.ops.utils.cache import AutotuneKey, CachedAutotuner

    # type(), not isinstance: isinstance reads __class__, which some lazy module proxies answer with a warning.
    tuners = [t for t in gc.get_objects() if type(t) is CachedAutotuner and t.cache]
    kernels: dict[str, dict] = {}
    for tuner in tuners:
        entries = kernels.setdefault(tuner.kernel_name, {})
        for key, config in tuner.cache.items():
            normalized = AutotuneKey.normalize_autotune_key(key)
            entries[AutotuneKey.key_hash(key)] = {"autotune_key": normalized, "config": _config_entry(config)}
    folder.mkdir(parents=True, exist_ok=True)
    for name, entries in kernels.items():
        data = {"kernel_name": name, "triton_version": triton.__version__,
                "gpu": torch.cuda.get_device_name(), "autotune_entries": entries}
        (folder / f"{name}.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return sorted(kernels)
