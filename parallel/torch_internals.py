"""Where the project relies on torch internals beyond its public API, each behind a version guard (a warning, once,
on a torch it was not checked on) and checked by tests/unit/test_torch_internals.py, which fails when a torch
release changes the behaviour relied on.

1. Dynamo keeps compiled frames per code object (`function_with_own_frames`): a function given a copy of another's
   code gets compiled frames of its own. The first decoder block uses that under FSDP (compile.py).
2. Selective activation checkpointing (from torch 2.13; 2.11 and 2.12 recompute such ops unmatched) matches every
   dispatched op of the recompute against the forward's, except
   the ops in `torch.utils.checkpoint.SAC_IGNORED_OPS`, a global set that
   `ignore_profiler_ranges_in_selective_checkpointing` adds the profiler's range ops to: FSDP2's hooks open profiler
   ranges a different number of times in the two (activation_checkpointing.py).
3. Functional collectives dispatch the ops of the `_c10d_functional` namespace (`functional_collective_ops`), which
   selective checkpointing keeps rather than recomputes (activation_checkpointing.py).
4. A `fullgraph=True` compile meeting a graph break raises `torch._dynamo.exc.Unsupported` at its first call, while
   tracing, before any of the function has run (`graph_break_error`): the compiled MoE half falls back to an eager
   checkpoint on it (activation_checkpointing.py).
5. The autograd engine runs a callback queued during a backward once that backward has finished
   (`run_when_backward_ends`): the replicated parameters' gradients are averaged then (replicated_params.py).
6. Outside a backward the current graph task id is -1; inside one, a checkpoint's recompute included, it is not
   (`inside_backward`): expert parallelism's recompute reuses the forward's split sizes (expert_parallel.py).
7. A module keeps its own parameters in the dict `_parameters`, which assignment, `to_empty()` and `.to()` update in
   place (`own_parameters`): what must find a module's current parameters at every forward reads them there,
   without nn.Module's attribute lookup, many times dearer (one_device_precision.py, replicated_params.py).
8. A tensor's version counter moves with every in-place change made through torch, and not with a kernel's writes
   through a raw pointer (`version_counters`): one GPU's weight copies are recast when their weight changed by
   anything but FastAdam's kernel, which writes the copy itself (one_device_precision.py).
9. A device mesh's dimensions flatten into one named dimension over the same ranks (`flatten_mesh`, torch's
   `DeviceMesh._flatten`), which the root mesh then slices by its name beside its other dimensions (torch warns that
   it will deprecate that slicing): the FSDP mesh and HSDP's (dp_replicate, dp_shard_cp), and the EP group
   (parallel_dims.py).
10. An LR scheduler's `get_last_lr()` returns its `_last_lr`, which only its `step()` sets (`set_last_lr`): a
   relaunch that sets the lr in force by hand sets it too, so the first step after it logs that lr
   (harness/optim/relaunch.py).
"""

from __future__ import annotations

import functools
import logging
import operator
import types
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

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


FUNCTIONAL_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


def functional_collective_ops() -> set:
    """The ops torch's functional collectives (torch.distributed._functional_collectives: all-gather,
    reduce-scatter, all-to-all) dispatch, those of this torch that exist."""
    _guard("functional_collective_ops (parallel/torch_internals.py)")
    namespace = torch.ops._c10d_functional
    return {getattr(namespace, name).default for name in FUNCTIONAL_COLLECTIVES if hasattr(namespace, name)}


def graph_break_error() -> type[Exception]:
    """What a `torch.compile(..., fullgraph=True)` function raises at its first call when it breaks the graph (a
    call dynamo does not trace, a `torch.compiler.disable`d function): found while tracing, nothing has run."""
    _guard("graph_break_error (parallel/torch_internals.py)")
    return torch._dynamo.exc.Unsupported


def run_when_backward_ends(callback: Callable[[], None]) -> None:
    """From inside a backward (a gradient hook): run `callback` once the whole backward has finished."""
    _guard("run_when_backward_ends (parallel/torch_internals.py)")
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def inside_backward() -> bool:
    """Whether the code runs within a backward pass (e.g. an activation-checkpointing recompute)."""
    _guard("inside_backward (parallel/torch_internals.py)")
    return torch._C._current_graph_task_id() != -1


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The live dict of `module`'s own parameters by name: it holds what `getattr(module, name)` returns, after any
    assignment, `to_empty()` or `.to()`."""
    _guard("own_parameters (parallel/torch_internals.py)")
    return module._parameters


_version = operator.attrgetter("_version")


def version_counters(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Each tensor's version counter, which every in-place change made through torch moves (an optimizer's step,
    `copy_`, `load_state_dict`) and a write through a raw pointer (a Triton kernel's store) does not."""
    _guard("version_counters (parallel/torch_internals.py)")
    return list(map(_version, tensors))


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The 1-D mesh named `name` over the ranks of `mesh`'s dimensions (a slice of a root mesh, row-major), which the
    root mesh then also slices by `name`."""
    _guard("flatten_mesh (parallel/torch_internals.py)")
    return mesh._flatten(name)


def set_last_lr(scheduler: torch.optim.lr_scheduler.LRScheduler, lrs: list[float]) -> None:
    """What the scheduler's `get_last_lr()` returns until its next `step()`."""
    _guard("set_last_lr (parallel/torch_internals.py)")
    scheduler._last_lr = list(lrs)
