"""The two places where the project relies on torch internals beyond its public API, each behind a version guard
and checked by tests/unit/test_torch_internals.py, which fails when a torch release changes what they rely on.

1. Dynamo keeps compiled frames per code object (`function_with_own_frames`): a function given a copy of another's
   code gets compiled frames of its own. The first decoder block uses that under FSDP (parallel/compile.py).
2. Selective activation checkpointing matches every dispatched op of the recompute against the forward's, except
   the ops in `torch.utils.checkpoint.SAC_IGNORED_OPS` (`ignore_profiler_ranges_in_selective_checkpointing`): FSDP2's
   hooks open profiler ranges a different number of times in the two (parallel/activation_checkpointing.py).
"""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

CHECKED_TORCH_VERSIONS = ("2.11", "2.13")


def _torch_minor() -> str:
    return ".".join(torch.__version__.split(".")[:2])


@functools.cache
def _guard(what: str) -> None:
    """Log once, per reliance, when the installed torch is not one it was checked on."""
    if _torch_minor() not in CHECKED_TORCH_VERSIONS:
        logger.warning("%s relies on torch internals checked on torch %s only, not %s: run "
                       "tests/unit/test_torch_internals.py", what, " and ".join(CHECKED_TORCH_VERSIONS),
                       torch.__version__)


def function_with_own_frames(fn: Callable, name: str) -> Callable:
    """`fn` with a copy of its code object, so that torch.compile keeps the copy's compiled frames (and their graph
    breaks) apart from `fn`'s."""
    _guard("function_with_own_frames (parallel/torch_internals.py)")
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__,
                              fn.__closure__)


def ignore_profiler_ranges_in_selective_checkpointing() -> None:
    """Make selective checkpointing skip the profiler's range ops when it matches the recompute's ops with the
    forward's (they compute nothing)."""
    _guard("selective activation checkpointing under FSDP (parallel/torch_internals.py)")
    from torch.utils import checkpoint as checkpoint_module

    if not isinstance(getattr(checkpoint_module, "SAC_IGNORED_OPS", None), set):
        raise RuntimeError(f"torch {torch.__version__} has no torch.utils.checkpoint.SAC_IGNORED_OPS set: selective "
                           f"activation checkpointing cannot skip FSDP2's profiler ranges; use "
                           f"activation_checkpoint.mode full")
    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
        packet = getattr(torch.ops.profiler, name, None)
        for overload in packet.overloads() if packet is not None else []:
            checkpoint_module.SAC_IGNORED_OPS.add(getattr(packet, overload))
