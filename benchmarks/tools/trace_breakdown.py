"""Where a traced step's GPU time goes, by kernel family, from torch.profiler chrome traces
(`--profiling.enable_profiling true`); given a second trace, what changed between the two.

    python benchmarks/tools/trace_breakdown.py <dump_folder>/profile_traces/iteration_N/rank0_trace.json [BASE_TRACE]

Only the kernels of the traced step count: those that ran inside the step's range on the GPU (the profiler's
`ProfilerStep#N` as the GPU ran it). A trace also holds the previous step's last kernels, which the GPU ran while
the host queued this step; counted, they would add the previous step's optimizer kernels to this step's. Kernels
are summed by family (dense and grouped GEMMs, FLA's delta rule, collectives, the optimizer, FSDP's copies,
inductor's fused kernels...). With a base trace, each family's difference and the kernels whose time changed most
follow: full activation checkpointing against none shows what the recompute runs, FSDP against one GPU what
sharding adds. Traces may be gzipped (.json.gz).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re

# First match wins: FSDP's chunk_cat must not count as FLA's chunk_* kernels, nor a grouped GEMM as a dense one.
FAMILIES = [
    ("collectives (NCCL)", r"nccl"),
    ("optimizer (FastAdam)", r"^_adam_step"),
    ("FSDP copy-in/out", r"chunk_cat|split_with_sizes_copy"),
    ("FLA delta rule", r"^(chunk_|recompute_w_u|prepare_wy)"),
    ("grouped GEMMs", r"GroupProblemShape|[Gg]rouped"),
    ("dense GEMMs", r"nvjet|gemm|Gemm|cutlass"),
    ("attention", r"flash|fmha"),
    ("causal conv", r"^_conv"),
    ("cross entropy", r"^_cross_entropy|^_slice_(stats|softmax)"),
    ("MoE combine", r"^_weighted_row_sum"),
    ("inductor fused", r"^triton_"),
    ("foreach ops", r"multi_tensor_apply"),
    ("sort, scan, top-k", r"[Ss]ort|[Ss]can|[Tt]op[Kk]"),
    ("reductions", r"reduce_kernel|[Rr]educe"),
    ("elementwise, copies", r"elementwise|[Cc]opy|[Ff]ill|Memcpy|Memset"),
]
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def family(name: str) -> str:
    return next((label for label, pattern in FAMILIES if re.search(pattern, name)), "other")


def load_events(path: str) -> list[dict]:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        return json.load(f)["traceEvents"]


def traced_step(events: list[dict], path: str) -> tuple[list[dict], float, bool]:
    """(the traced step's GPU events by start time, the step's span on the GPU in us, whether a step range was
    found; without one, e.g. a trace without host events, all GPU events count)."""
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES and "dur" in e), key=lambda e: e["ts"])
    if not gpu:
        raise SystemExit(f"{path}: no GPU events (a CPU run?)")
    steps = [e for e in events
             if e.get("cat") == "gpu_user_annotation" and e.get("name", "").startswith("ProfilerStep")]
    if not steps:
        return gpu, max(e["ts"] + e["dur"] for e in gpu) - gpu[0]["ts"], False
    step = max(steps, key=lambda e: e["dur"])
    start, end = step["ts"], step["ts"] + step["dur"]
    return [e for e in gpu if start <= e["ts"] < end], end - start, True


def by_family(kernels: list[dict]) -> dict[str, list[float]]:
    """family -> [us, count]"""
    sums = collections.defaultdict(lambda: [0.0, 0])
    for k in kernels:
        row = sums[family(k["name"])]
        row[0] += k["dur"]
        row[1] += 1
    return sums


def total_ms(kernels: list[dict]) -> float:
    return sum(k["dur"] for k in kernels) / 1e3


def by_name(kernels: list[dict]) -> dict[str, float]:
    sums = collections.defaultdict(float)
    for k in kernels:
        sums[k["name"]] += k["dur"]
    return sums


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace", help="a rank's chrome trace (.json or .json.gz)")
    parser.add_argument("base", nargs="?", help="a second trace to compare against (e.g. the run without the change)")
    parser.add_argument("--top", type=int, default=12, help="kernels listed by their change against the base")
    args = parser.parse_args()
    kernels, span, found = traced_step(load_events(args.trace), args.trace)
    base, base_span = traced_step(load_events(args.base), args.base)[:2] if args.base else (None, None)
    scope = "traced step" if found else "whole trace (no ProfilerStep range: traced without host events?)"
    compared = f"; base {base_span / 1e3:.1f} ms, kernels {total_ms(base):.1f} ms" if base else ""
    print(f"{args.trace}: {scope} {span / 1e3:.1f} ms on the GPU, kernels {total_ms(kernels):.1f} ms{compared}")
    ours = by_family(kernels)
    theirs = by_family(base) if base else {}
    header = f"{'family':24s} {'ms':>8s} {'kernels':>8s}" + (f" {'base ms':>8s} {'change':>8s}" if base else "")
    print(header)
    for name in sorted(set(ours) | set(theirs), key=lambda n: -ours.get(n, [0])[0]):
        us, count = ours.get(name, [0.0, 0])
        row = f"{name:24s} {us / 1e3:8.2f} {count:8d}"
        if base:
            b = theirs.get(name, [0.0, 0])[0]
            row += f" {b / 1e3:8.2f} {(us - b) / 1e3:+8.2f}"
        print(row)
    if base:
        mine, other = by_name(kernels), by_name(base)
        changes = sorted(set(mine) | set(other), key=lambda n: -abs(mine.get(n, 0) - other.get(n, 0)))
        print("kernels that changed most (ms, this trace - base):")
        for name in changes[:args.top]:
            print(f"{(mine.get(name, 0) - other.get(name, 0)) / 1e3:+8.2f}  {name[:110]}")


if __name__ == "__main__":
    main()
