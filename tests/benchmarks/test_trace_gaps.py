"""benchmarks/tools/trace_gaps.py on hand-made profiler traces: where the GPU idles, and what it waited for."""

from __future__ import annotations

import gzip
import json

from tests.benchmarks.scripts import printed_by


def test_trace_gaps_counts_idle_time_once_over_streams_and_names_the_launching_op(tmp_path):
    """benchmarks/tools/trace_gaps.py on a hand-made trace: kernels on two streams overlap (busy counted once), and the
    idle time before a kernel goes to the host ops around its launch."""

    def op(name, ts, dur, cat="cpu_op", **args):
        return {"name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": 1, "args": args}

    def kernel(ts, dur, correlation, stream):
        return {"name": f"k{correlation}", "cat": "kernel", "ts": ts, "dur": dur, "pid": 0, "tid": stream,
                "args": {"correlation": correlation}}

    events = [op("ProfilerStep#6", 0, 2000, "user_annotation"), op("Optimizer.step#FastAdam.step", 100, 1500),
              op("aten::mul", 110, 20), op("cudaLaunchKernel", 115, 5, "cuda_runtime", correlation=1),
              op("cudaLaunchKernel", 900, 5, "cuda_runtime", correlation=2),
              kernel(120, 300, 1, 7), kernel(200, 400, 3, 8),  # overlap: busy 120..600
              kernel(1000, 100, 2, 7)]  # 400 us idle before it, launched under FastAdam.step
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = printed_by("tools/trace_gaps.py", str(path))
    assert "GPU busy 0.6 ms of 1.0 ms traced; idle 0.4 ms in 1 gaps" in out
    assert "0.40 ms  Optimizer.step#FastAdam.step > cudaLaunchKernel" in out


def test_trace_gaps_splits_the_compute_streams_idle_time_by_whether_a_collective_ran(tmp_path):
    """benchmarks/tools/trace_gaps.py's compute-stream view on a hand-made gzipped trace: stream 7 (the most kernels)
    idles 0.5 ms while an NCCL kernel on stream 9 runs across the gap (FSDP's compute waiting on a gather; the
    GPU-wide view counts it busy) and 0.3 ms with no collective (waiting on the host); a 0.1 ms gap is below
    --min-gap 0.2 and not counted."""

    def kernel(name, ts, dur, stream):
        return {"name": name, "cat": "kernel", "ts": ts, "dur": dur, "pid": 0, "tid": stream,
                "args": {"stream": stream}}

    events = [kernel("gemm", 0, 100, 7), kernel("ncclDevKernel_AllGather_RING_LL", 50, 600, 9),
              kernel("gemm", 600, 100, 7),  # 500 us after the first, the gather across it
              kernel("norm", 1000, 100, 7),  # 300 us after, nothing else running
              kernel("gemm", 1200, 100, 7)]  # 100 us: below --min-gap
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    out = printed_by("tools/trace_gaps.py", str(path), "--min-gap", "0.2")
    assert ("compute stream 7: idle 0.8 ms in 2 gaps of >= 0.2 ms: 0.5 ms while a collective ran, 0.3 ms with "
            "none") in out
    assert "0.50 ms at     0.1 ms, before gemm; collectives: ncclDevKernel_AllGather_RING_LL (0.60 ms)" in out
    assert "0.30 ms at     0.7 ms, before norm; collectives: none" in out


def test_trace_gaps_counts_only_the_traced_steps_kernels(tmp_path):
    """benchmarks/tools/trace_gaps.py with the GPU's ProfilerStep range in the trace: the previous step's last kernel,
    which ran before the range, and the idle time after it are not this step's."""

    def kernel(name, ts, dur):
        return {"name": name, "cat": "kernel", "ts": ts, "dur": dur, "pid": 0, "tid": 7, "args": {"stream": 7}}

    step = {"name": "ProfilerStep#6", "cat": "gpu_user_annotation", "ts": 1000, "dur": 1000, "pid": 0, "tid": 7}
    events = [step, kernel("_adam_step", 0, 300),  # the previous step's, 700 us before the range
              kernel("gemm", 1000, 200), kernel("norm", 1300, 200)]  # 100 us idle between them
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = printed_by("tools/trace_gaps.py", str(path))
    assert "GPU busy 0.4 ms of 0.5 ms traced; idle 0.1 ms in 1 gaps" in out
