"""Where the GPU waits for the host, from a torch.profiler chrome trace (`--profiling.enable_profiling true`).

    python benchmarks/tools/trace_gaps.py <dump_folder>/profile_traces/iteration_N/rank0_trace.json

Prints the GPU's busy time (the union over streams) against the traced span, the idle gaps by size, and the idle
time before each kernel attributed to the host ops that launched it (outermost two, and innermost non-aten one):
a compiled step that is not faster than its GPU time says which host work to take away.

Then the compute stream alone (the stream that ran the most kernels): a collective kernel (NCCL) counts as busy
above even while it only waits for data, so under FSDP the GPU looks busy while its compute waits. Its gaps of
at least --min-gap ms are split into those during which a collective ran (compute waiting on communication) and
those with none (waiting on the host), the largest listed with the collectives across them. The trace may be
gzipped (.json.gz).
"""

from __future__ import annotations

import argparse
import collections

from trace_breakdown import load_events, traced_step


def _gaps(kernels: list[dict]) -> tuple[float, float, list[tuple[float, dict]]]:
    """(busy, span, [(idle before kernel, kernel)]) over kernels sorted by start (any stream)."""
    busy, end, gaps = 0.0, None, []
    for k in kernels:
        start, stop = k["ts"], k["ts"] + k["dur"]
        if end is None or start > end:
            if end is not None:
                gaps.append((start - end, k))
            busy, end = busy + stop - start, stop
        elif stop > end:
            busy, end = busy + stop - end, stop
    return busy, end - kernels[0]["ts"], gaps


def parents(ops: list[dict]) -> dict[int, dict | None]:
    """Each host op's enclosing op on its thread (by time nesting)."""
    parent = {}
    threads = collections.defaultdict(list)
    for e in ops:
        threads[(e["pid"], e["tid"])].append(e)
    for seq in threads.values():
        stack = []
        for e in sorted(seq, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < e["ts"] + e["dur"]:
                stack.pop()
            parent[id(e)] = stack[-1] if stack else None
            stack.append(e)
    return parent


def _compute_stream_gaps(kernels: list[dict], min_gap_us: float, top: int) -> None:
    """The compute stream's idle gaps, each with the collectives that ran across it."""
    stream_of = lambda k: k.get("args", {}).get("stream", k["tid"])  # noqa: E731
    compute = collections.Counter(stream_of(k) for k in kernels).most_common(1)[0][0]
    collectives = [k for k in kernels if "nccl" in k["name"].lower()]
    rows, end = [], None
    for k in (k for k in kernels if stream_of(k) == compute):
        if end is not None and k["ts"] - end >= min_gap_us:
            across = [c for c in collectives if c["ts"] < k["ts"] and c["ts"] + c["dur"] > end]
            rows.append((k["ts"] - end, end, k, across))
        end = k["ts"] + k["dur"] if end is None else max(end, k["ts"] + k["dur"])
    waiting = sum(idle for idle, _, _, across in rows if across)
    host = sum(idle for idle, _, _, across in rows if not across)
    print(f"compute stream {compute}: idle {(waiting + host) / 1e3:.1f} ms in {len(rows)} gaps of >= "
          f"{min_gap_us / 1e3:g} ms: {waiting / 1e3:.1f} ms while a collective ran, {host / 1e3:.1f} ms with none")
    start = kernels[0]["ts"]
    for idle, at, kernel, across in sorted(rows, key=lambda row: -row[0])[:top]:
        names = ", ".join(f"{c['name'][:40]} ({c['dur'] / 1e3:.2f} ms)" for c in across) or "none"
        print(f"{idle / 1e3:8.2f} ms at {(at - start) / 1e3:7.1f} ms, before {kernel['name'][:40]}; "
              f"collectives: {names}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace", help="a rank's chrome trace (.json or .json.gz)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--min-gap", type=float, default=0.2, help="the compute stream's gaps counted, in ms")
    args = parser.parse_args()
    events = load_events(args.trace)
    kernels = traced_step(events, args.trace)[0]  # the previous step's last kernels are not this step's
    busy, span, gaps = _gaps(kernels)
    print(f"GPU busy {busy / 1e3:.1f} ms of {span / 1e3:.1f} ms traced; idle {(span - busy) / 1e3:.1f} ms "
          f"in {len(gaps)} gaps")
    ops = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function", "cuda_runtime")
           and "dur" in e]
    parent = parents(ops)
    launches = {e["args"]["correlation"]: e for e in ops
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    by_size, by_outer, by_inner = collections.Counter(), collections.Counter(), collections.Counter()
    for idle, kernel in gaps:
        by_size["<20 us" if idle < 20 else "20-100 us" if idle < 100 else "0.1-1 ms" if idle < 1000 else ">1 ms"] += idle
        chain, op = [], launches.get(kernel.get("args", {}).get("correlation"))
        while op is not None:
            if not op["name"].startswith("ProfilerStep"):
                chain.append(op["name"])
            op = parent.get(id(op))
        if not chain:
            chain = ["(no launch in the trace)"]
        by_outer[" > ".join(name[:45] for name in reversed(chain[-2:]))] += idle
        by_inner[next((n for n in chain if not n.startswith(("aten::", "cuda", "cuLaunch"))), chain[0])[:90]] += idle
    print("idle by gap size (ms):", {k: round(v / 1e3, 1) for k, v in by_size.most_common()})
    for title, counter in (("outermost two host ops", by_outer), ("innermost non-aten host op", by_inner)):
        print(f"idle before kernels launched under ({title}):")
        for name, idle in counter.most_common(args.top):
            print(f"{idle / 1e3:8.2f} ms  {name}")
    _compute_stream_gaps(kernels, args.min_gap * 1e3, args.top)


if __name__ == "__main__":
    main()
