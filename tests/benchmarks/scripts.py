"""The benchmarks/ scripts as the tests call them: run as a user runs them, or loaded as a module."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def printed_by(script: str, *args: str) -> str:
    """What benchmarks/`script` printed, run with `args`; it must exit with 0 (the timeout guards a hang only)."""
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True,
                          check=True, timeout=600).stdout


def loaded(script: str) -> ModuleType:
    """benchmarks/`script` imported as a module of its own name (registered: a dataclass in it resolves its
    annotations through sys.modules)."""
    name = Path(script).stem
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
