"""FLA's Triton kernels in this suite run with the configs FLA's autotuner picked for these tests on an H200
(`fla_configs/`, one JSON per kernel in FLA's own config-cache format), on Hopper GPUs only. On a fresh
machine each kernel then compiles once instead of once per candidate config and is not benchmarked: the suite
took 8 minutes there, most of it autotuning. A config chooses tiling, not math; training autotunes as usual.

Regenerate after an FLA or Triton upgrade (a config a kernel no longer has would fail to launch):
    FLA_CONFIGS_DUMP=tests/gpu/fla_configs python -m pytest tests/gpu
autotunes every kernel (the pinned configs are not read then) and writes what it chose (fla_config_dump.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.gpu.fla_config_dump import dump_fla_configs

FLA_CONFIGS = Path(__file__).with_name("fla_configs")
_DUMP = os.environ.get("FLA_CONFIGS_DUMP")

# Before FLA is imported: it reads FLA_CACHE_MODE once, at import. "fuzzy": a kernel whose autotune key has no
# entry here falls back to autotuning. Hopper only: a config tuned on an H200 may not fit another GPU's limits.
if (not _DUMP and "FLA_CACHE_MODE" not in os.environ and torch.cuda.is_available()
        and torch.cuda.get_device_capability()[0] == 9):
    os.environ["FLA_CACHE_MODE"] = "fuzzy"
    os.environ["FLA_CONFIG_DIR"] = str(FLA_CONFIGS)


def pytest_report_header(config):
    """Where FLA's configs come from: set outside (a benchmark's FLA_CONFIG_DIR, say), the pinned ones are not read
    and every kernel these tests' shapes miss there autotunes, which takes minutes."""
    where = os.environ.get("FLA_CONFIG_DIR")
    if torch.cuda.is_available() and where is not None and Path(where).resolve() != FLA_CONFIGS.resolve():
        return (f"FLA configs: FLA_CONFIG_DIR={where} from the environment, not {FLA_CONFIGS}: kernels of these "
                "tests' shapes autotune (minutes); unset FLA_CACHE_MODE and FLA_CONFIG_DIR for the pinned ones")
    return None


def pytest_sessionfinish(session, exitstatus):
    if _DUMP:
        written = dump_fla_configs(Path(_DUMP))
        print(f"\nFLA configs of {len(written)} kernels written to {_DUMP}: {', '.join(written)}")
