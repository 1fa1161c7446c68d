"""benchmarks/tools/trace_host.py on a hand-made profiler trace: a step's host time, split and ranked.
(On a trace the trainer wrote: tests/unit/test_profiling.py.)"""

from __future__ import annotations

import json

from tests.benchmarks.scripts import printed_by


def test_trace_host_splits_the_steps_host_time_and_names_waits_hooks_and_exclusive_time(tmp_path):
    """benchmarks/tools/trace_host.py on a hand-made trace: the step's host range (100 ms; the GPU's starts 20 ms later)
    split at the first and last backward op (on the autograd thread, 2); the wait in a gloo collective and the
    sync after the step; FSDP's outermost hooks only (the all-gather nested in pre_forward is not counted twice);
    exclusive times with children taken out (chunk_cat's 4 ms less its 0.5 ms allocation); an op after the step
    is not the step's, nor is the GPU's range of the step before."""

    def op(name, ts_ms, dur_ms, tid=1, cat="cpu_op"):
        return {"name": name, "cat": cat, "ph": "X", "ts": ts_ms * 1000, "dur": dur_ms * 1000, "pid": 0, "tid": tid}

    events = [
        op("ProfilerStep#6", 0, 100, cat="user_annotation"), op("ProfilerStep#6", 20, 90, 7, "gpu_user_annotation"),
        op("ProfilerStep#5", -95, 95, 7, "gpu_user_annotation"),  # the step before, on the GPU: not this one
        op("gloo:all_reduce", 1, 5),
        op("FSDP::pre_forward (layers.0)", 10, 3, cat="user_annotation"),
        op("FSDP::all_gather (layers.0)", 10.5, 1, cat="user_annotation"),
        op("FSDP::forward_prefetch for layers.1", 14, 1, cat="user_annotation"),
        op("autograd::engine::evaluate_function: MmBackward0", 40, 1, tid=2),
        op("FSDP::post_backward_reduce (layers.0)", 59, 6, tid=2, cat="user_annotation"),
        op("aten::_chunk_cat", 60, 4, tid=2), op("aten::empty", 63, 0.5, tid=2),
        op("autograd::engine::evaluate_function: EmbeddingBackward0", 80, 2, tid=2),
        op("Optimizer.step#FastAdam.step", 85, 6, cat="user_annotation"),
        op("cudaDeviceSynchronize", 100.5, 2.5, cat="cuda_runtime"),
        op("aten::mm", 200, 50),  # the next step's: not counted
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = printed_by("tools/trace_host.py", str(path), "--top", "3")
    lines = [line.strip() for line in out.splitlines()]
    assert lines[0].endswith("ProfilerStep#6, host 100.0 ms, GPU 90.0 ms")
    assert lines[1:5] == [
        ("up to the backward 40.0 ms (the loop's tail, then the forward), backward 42.0 ms, then 18.0 ms "
         "(optimizer.step 6.0 ms)"),
        "the GPU started the step 20.0 ms after the host",
        "host waited 5.0 ms in CPU collectives (1: gloo:all_reduce)",
        "host waited 2.5 ms in GPU syncs (1: cudaDeviceSynchronize)"]
    hooks = lines[lines.index("FSDP hooks 10.0 ms:") + 1:][:3]
    assert [row.split() for row in hooks] == [["6.00", "ms", "x1", "post_backward_reduce"],
                                             ["3.00", "ms", "x1", "pre_forward"],
                                             ["1.00", "ms", "x1", "forward_prefetch"]]
    ranked = lines[lines.index("most exclusive host time (of 24.0 ms in the step's ops, all threads):") + 1:]
    assert [row.split()[0] for row in ranked] == ["6.00", "5.00", "3.50"]
    assert ranked[2].endswith("aten::_chunk_cat") and "(longest 3.50)" in ranked[2]
