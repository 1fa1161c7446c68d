"""Where a traced step's host time goes, from torch.profiler chrome traces (`--profiling.enable_profiling true`).

    python benchmarks/tools/trace_host.py <dump_folder>/profile_traces/iteration_N/rank*_trace.json

A step whose GPU waits for its host (trace_gaps.py says when) is made faster by taking host work away. Per trace:
the traced step's host span (`ProfilerStep#N` on the thread that ran it) split into the forward (up to the first
backward op, on any thread), the backward (first to last backward op) and what follows (the optimizer), how far
the host ran ahead of its GPU (when the GPU started the step after the host did, and how long the host then
waited for the GPU at a sync), FSDP's hooks by kind (outermost `FSDP::` ranges), and the host ops with the most
exclusive time (their own, their children's taken out): Python-heavy hooks, or waits inside one op.

Under FSDP the ranks wait for each other at every collective, so the step runs at the pace of the slowest host:
run it on every rank's trace. Traces may be gzipped (.json.gz).
"""

from __future__ import annotations

import argparse
import collections
import re

from trace_breakdown import load_events
from trace_gaps import parents

HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")
SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize")
BACKWARD = "autograd::engine::evaluate_function"


def host_step(events: list[dict], path: str) -> tuple[dict, dict | None]:
    """(the traced step's host range, the longest; the same step's range on the GPU, if the trace has it)."""
    steps = [e for e in events if e.get("cat") == "user_annotation" and e.get("name", "").startswith("ProfilerStep")]
    if not steps:
        raise SystemExit(f"{path}: no ProfilerStep range (a trace from the trainer's profiler has one)")
    step = max(steps, key=lambda e: e["dur"])
    on_gpu = [e for e in events if e.get("cat") == "gpu_user_annotation" and e.get("name") == step["name"]]
    return step, on_gpu[0] if on_gpu else None


def exclusive_times(ops: list[dict]) -> dict[int, float]:
    """id(op) -> its duration less its direct children's (nesting by time on each thread)."""
    own, parent = {id(op): op["dur"] for op in ops}, parents(ops)
    for op in ops:
        if parent[id(op)] is not None:
            own[id(parent[id(op)])] -= op["dur"]
    return own


def outermost(ops: list[dict]) -> list[dict]:
    """The ops not nested in another of `ops` on their thread."""
    parent = parents(ops)
    return [op for op in ops if parent[id(op)] is None]


def hook_kind(name: str) -> str:
    """'FSDP::pre_forward (layers.1)' -> 'pre_forward'; 'FSDP::forward_prefetch for layers.2' -> 'forward_prefetch'."""
    return re.sub(r"\s*(\(.*\)|for \S+)\s*$", "", name.removeprefix("FSDP::"))


def ms(us: float) -> str:
    return f"{us / 1e3:.1f} ms"


def report(path: str, top: int) -> list[str]:
    events = [e for e in load_events(path) if e.get("ph") == "X" and "dur" in e]
    step, gpu_step = host_step(events, path)
    start, end = step["ts"], step["ts"] + step["dur"]
    ops = [e for e in events if e.get("cat") in HOST_CATEGORIES and start <= e["ts"] < end]
    backward = [e for e in ops if e["name"].startswith(BACKWARD)]
    lines = [f"{path}: {step['name']}, host {ms(step['dur'])}"
             + (f", GPU {ms(gpu_step['dur'])}" if gpu_step else "")]
    if backward:
        first, last = min(e["ts"] for e in backward), max(e["ts"] + e["dur"] for e in backward)
        optimizer = sum(e["dur"] for e in ops if e["name"].startswith("Optimizer.step"))
        lines.append(f"  up to the backward {ms(first - start)} (the loop's tail, then the forward), backward "
                     f"{ms(last - first)}, then {ms(end - last)} (optimizer.step {ms(optimizer)})")
    if gpu_step:
        lines.append(f"  the GPU started the step {ms(gpu_step['ts'] - start)} after the host")
    # Waits, not work: for the other ranks' hosts (a CPU collective, e.g. the per-step stop check), or for the GPU
    # (a sync: the profiler's own at the step's end tells how far ahead the host was)
    cpu_collectives = [e for e in ops if e["name"].startswith("gloo:")]
    syncs = [e for e in events if e.get("name") in SYNCS and e["tid"] == step["tid"] and e["ts"] >= start]
    for label, waits in (("CPU collectives", cpu_collectives), ("GPU syncs", syncs)):
        if waits:
            lines.append(f"  host waited {ms(sum(e['dur'] for e in waits))} in {label} ({len(waits)}: "
                         f"{', '.join(sorted({e['name'] for e in waits}))})")
    hooks = outermost([e for e in ops if e["name"].startswith("FSDP::")])
    if hooks:
        kinds = collections.defaultdict(lambda: [0.0, 0])
        for hook in hooks:
            kinds[hook_kind(hook["name"])][0] += hook["dur"]
            kinds[hook_kind(hook["name"])][1] += 1
        lines.append(f"  FSDP hooks {ms(sum(h['dur'] for h in hooks))}:")
        lines += [f"    {us / 1e3:7.2f} ms  x{n:<4d} {kind}"
                  for kind, (us, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0])]
    own = exclusive_times(ops)
    by_name = collections.defaultdict(lambda: [0.0, 0, 0.0])
    for op in ops:
        if op is step:  # its own time is the untraced rest: Python between ops, the main thread's wait in backward
            continue
        row = by_name[op["name"]]
        row[0] += own[id(op)]
        row[1] += 1
        row[2] = max(row[2], own[id(op)])
    lines.append(f"  most exclusive host time (of {ms(sum(own.values()) - own[id(step)])} in the step's ops, "
                 f"all threads):")
    lines += [f"    {us / 1e3:7.2f} ms  x{n:<4d} (longest {most / 1e3:.2f})  {name[:90]}"
              for name, (us, n, most) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--top", type=int, default=12, help="host ops listed by exclusive time")
    ns = parser.parse_args()
    for path in ns.traces:
        print("\n".join(report(path, ns.top)))


if __name__ == "__main__":
    main()
