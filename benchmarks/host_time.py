"""Where a training step's host time goes, measured without a profiler.

    torchrun --nproc-per-node 2 benchmarks/host_time.py --layers 8 --experts 32 --steps 40 --warmup 10 -- \
        --training.local_batch_size 2 --activation_checkpoint.mode none --compile.enable true

Runs train_throughput.py's benchmark (same arguments) with wall-clock timers around the parts of a step that run
eager Python on the host: FSDP2's hooks, the optimizer step (and zero_grad), the gated delta rule's autograd
function (FLA's kernels launched from Python), the chunked cross entropy, the vocabulary-parallel embedding, the
replicated parameters' all-reduce, the inputs' layouts, the loss's bookkeeping and the gradient norm, the per-step
stop check and the metrics' reads. Each rank
prints its mean milliseconds per step over the steps after warm-up: the host time of queueing a step (`Trainer._step`)
and each part's share of it. With CUDA the kernels run asynchronously, so a part's time is its host work plus any
wait inside it; one that waits for the GPU or another rank shows up as a part that is long for its work.

Finer timers (FSDP2's gathers and reductions, Triton's Python launches) are reported apart, after the parts: they
run inside them.

Why not torch.profiler: it adds its own cost to every op and (with Python stacks) every call, so small, frequent host
work looks far bigger than it is. FastAdam's 141 step counters took 2.4 ms in a trace and 0.17 ms untraced; a trace
with Python stacks doubled a whole FSDP step's host time. A part here costs two clock reads per call.
"""

from __future__ import annotations

import collections
import functools
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_inside = threading.local()  # a timed part already running on this thread: nested parts count in the outer one
_current: collections.Counter = collections.Counter()  # part -> seconds, in the step being queued
DETAIL = "within: "  # the prefix of a finer timer's entries in _current and _calls
_calls: collections.Counter = collections.Counter()  # detail -> calls, over the whole run
_open_details: set[str] = set()  # details running now on any thread (a detail's own nesting counts once)
_steps: list[dict[str, float]] = []
_starts: list[float] = []  # when each step began queueing: their spacing is the pace of the run


def _timed(part: str, fn):
    import torch

    # Not traced: dynamo would otherwise break the graph at the clock reads inside a compiled block's call, where
    # FSDP's forward hooks run. Those hooks are themselves not traced (skip_fsdp_hooks), so their breaks stay put.
    @torch.compiler.disable
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if getattr(_inside, "part", None) is not None:
            return fn(*args, **kwargs)
        _inside.part, start = part, time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _current[part] += time.perf_counter() - start
            _inside.part = None
    return wrapper


def _timed_detail(detail: str, fn):
    """A finer timer inside the parts (FSDP2's gathers and reductions, Triton's Python launches): counted whether or
    not a part is running, and reported apart, so the parts still add up to the step."""
    import torch

    @torch.compiler.disable
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if detail in _open_details:
            return fn(*args, **kwargs)
        _open_details.add(detail)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _current[DETAIL + detail] += time.perf_counter() - start
            _calls[DETAIL + detail] += 1
            _open_details.discard(detail)
    return wrapper


def _timed_step(fn):
    """Trainer._step: the step's own host time, and the end of its parts' accounting."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        _starts.append(start)
        try:
            return fn(*args, **kwargs)
        finally:
            _current["step"] += time.perf_counter() - start
            _steps.append(dict(_current))
            _current.clear()
    return wrapper


def _parts():
    """(owner, attribute, part name): what gets a timer. Each must exist: a torch or FLA upgrade that renames one
    fails here, not silently."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    import harness.trainer as trainer_module
    from harness.fast_adam import FastAdam
    from harness.preemption import StopRequested
    from harness.trainer import Trainer
    from models.qwen35_moe.fla_saved_states import SavedStatesGatedDeltaRule
    from models.qwen35_moe.linear_cross_entropy import _LinearCrossEntropy
    from parallel.replicated_params import ReplicatedParams
    from parallel.vocab_parallel import VocabShard

    return [(FSDPState, "_pre_forward", "FSDP pre-forward"), (FSDPState, "_post_forward", "FSDP post-forward"),
            (FSDPState, "_pre_backward", "FSDP pre-backward"), (FSDPParamGroup, "post_backward", "FSDP post-backward"),
            (FSDPState, "_root_post_backward_final_callback", "FSDP final callback"),
            (FastAdam, "step", "optimizer step"),
            (SavedStatesGatedDeltaRule, "forward", "gated delta rule forward"),
            (SavedStatesGatedDeltaRule, "backward", "gated delta rule backward"),
            (_LinearCrossEntropy, "forward", "cross entropy forward"),
            (_LinearCrossEntropy, "backward", "cross entropy backward"),
            (VocabShard, "embed", "vocabulary-parallel embedding"),
            (ReplicatedParams, "_average", "replicated parameters' all-reduce"),
            (Trainer, "model_inputs", "inputs and their document layouts"),
            (trainer_module, "global_label_tokens", "label tokens' count"),
            (trainer_module, "balance_loss_share", "balance loss"),
            (trainer_module, "clip_grad_norm_", "gradient norm and clipping"),
            (FastAdam, "zero_grad", "zero_grad"),
            (StopRequested, "agreed", "stop check (between steps)"),
            (Trainer, "read_pending", "metrics read (between steps)")]


def _details():
    """(owner, attribute, detail name): finer timers; ones this torch or Triton lacks are left out."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    wanted = [(param_group, "foreach_all_gather", "FSDP gather: copy-in and launch"),
              (_fsdp_collectives, "_get_param_all_gather_inputs", "FSDP gather: the shards' casts"),
              (param_group, "foreach_all_gather_copy_out", "FSDP gather: copy-out"),
              (FSDPParam, "init_unsharded_param", "FSDP gather: unsharded parameters' setup"),
              (param_group.FSDPParamGroup, "reshard", "FSDP reshard"),
              (param_group, "foreach_reduce", "FSDP reduce-scatter: copy-in, launch, gradients' DTensors"),
              (param_group.FSDPParamGroup, "_register_post_backward_hook", "FSDP forward's autograd hook")]
    try:
        from torch._inductor.output_code import CompiledFxGraph
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
        wanted += [(CompiledFxGraph, "__call__", "inductor's compiled graphs, their launches included"),
                   (CachingAutotuner, "run", "inductor's kernel launches")]
    except ImportError:
        pass
    try:
        from triton.runtime.autotuner import Autotuner, Heuristics
        from triton.runtime.jit import JITFunction
        wanted += [(Autotuner, "run", "Triton autotuner's launches (FLA)"),
                   (Heuristics, "run", "Triton heuristics' launches (FLA)"),
                   (JITFunction, "run", "Triton JIT launches (FLA, FastAdam, ours)"),
                   (JITFunction, "_do_compile", "Triton compiles (or loads from its disk cache)"),
                   (Autotuner, "_bench", "Triton autotuning's benchmarks")]
    except ImportError:
        pass
    return [(owner, name, detail) for owner, name, detail in wanted if name in vars(owner)]


def install() -> None:
    """Timers on every part (before the model and optimizer are built: FSDP registers its hooks as bound methods)."""
    from harness.trainer import Trainer

    for owner, name, part in _parts():
        raw = owner.__dict__[name]  # KeyError: renamed upstream
        if isinstance(raw, staticmethod):
            setattr(owner, name, staticmethod(_timed(part, raw.__func__)))
        else:
            setattr(owner, name, _timed(part, raw))
    for owner, name, detail in _details():
        setattr(owner, name, _timed_detail(detail, vars(owner)[name]))
    Trainer._step = _timed_step(Trainer._step)


def report(warmup: int) -> list[str]:
    """Mean milliseconds per step over the steps after `warmup`, the step first, then the parts, longest first."""
    steps = _steps[warmup:]
    if not steps:
        return [f"host_time: no steps after the {warmup} of warm-up"]
    means = {part: 1e3 * sum(s.get(part, 0.0) for s in steps) / len(steps) for part in {p for s in steps for p in s}}
    step = means.pop("step")
    rank = os.environ.get("RANK", "0")
    starts = _starts[warmup:]
    pace = f", one every {1e3 * (starts[-1] - starts[0]) / (len(starts) - 1):.1f} ms" if len(starts) > 1 else ""
    # Queueing close to the pace: the host bounds the run. Well below it: the GPU (or another rank) does.
    lines = [f"host_time rank {rank}: {len(steps)} steps{pace}, queueing a step {step:.1f} ms of host time (mean); "
             f"parts:"]
    # Within the step the parts never overlap (the main thread waits while the autograd thread runs the backward):
    # what they leave is the compiled regions, the eager ops around them and the kernel launches.
    details = {part: means.pop(part) for part in list(means) if part.startswith(DETAIL)}
    means["the rest of the step"] = step - sum(ms for part, ms in means.items() if "between steps" not in part)
    lines += [f"host_time rank {rank}:   {ms:7.2f} ms  {part}"
              for part, ms in sorted(means.items(), key=lambda item: -item[1])]
    # A detail's calls over the whole run, warm-up included: a compile or an autotuning after warm-up stands out
    lines += [f"host_time rank {rank}:   {ms:7.2f} ms  {part} ({_calls[part]} calls in all)"
              for part, ms in sorted(details.items(), key=lambda item: -item[1])]
    return lines


def main() -> int:
    import argparse

    import train_throughput

    ours = sys.argv[1:sys.argv.index("--")] if "--" in sys.argv else sys.argv[1:]
    parser = argparse.ArgumentParser(add_help=False)  # train_throughput's --warmup, read here too
    parser.add_argument("--warmup", type=int, default=5)
    warmup = parser.parse_known_args(ours)[0].warmup
    install()
    code = train_throughput.main_bench()
    for line in report(warmup):
        print(line, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
