"""FLA's Triton kernels in this suite run with the configs FLA's autotuner picked for these tests on an H200
(`fla_configs/`, one JSON per kernel in FLA's own config-cache format), on Hopper GPUs only. On a fresh
machine each kernel then compiles once instead of once per candidate config and is not benchmarked: the suite
took 8 minutes there, most of it autotuning. A config chooses tiling, not math; training autotunes as usual.

Regenerate after an FLA or Triton upgrade (a config a kernel no longer has would fail to launch):
    FLA_CONFIGS_DUMP=tests/gpu/fla_configs python -m pytest tests/gpu
autotunes every kernel (the pinned configs are not read then) and writes what it chose.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import torch

FLA_CONFIGS = Path(__file__).with_name("fla_configs")
_DUMP = os.environ.get("FLA_CONFIGS_DUMP")

# Before FLA is imported: it reads FLA_CACHE_MODE once, at import. "fuzzy": a kernel whose autotune key has no
# entry here falls back to autotuning. Hopper only: a config tuned on an H200 may not fit another GPU's limits.
if (not _DUMP and "FLA_CACHE_MODE" not in os.environ and torch.cuda.is_available()
        and torch.cuda.get_device_capability()[0] == 9):
    os.environ["FLA_CACHE_MODE"] = "fuzzy"
    os.environ["FLA_CONFIG_DIR"] = str(FLA_CONFIGS)


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


def pytest_sessionfinish(session, exitstatus):
    if _DUMP:
        written = dump_fla_configs(Path(_DUMP))
        print(f"\nFLA configs of {len(written)} kernels written to {_DUMP}: {', '.join(written)}")
