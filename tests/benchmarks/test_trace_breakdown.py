"""benchmarks/tools/trace_breakdown.py on hand-made profiler traces: a step's kernels by family, against a base."""

from __future__ import annotations

import json

from tests.benchmarks.scripts import printed_by


def test_trace_breakdown_counts_the_traced_steps_kernels_by_family_and_the_change_against_a_base(tmp_path):
    """benchmarks/tools/trace_breakdown.py on two hand-made traces: only kernels inside the GPU's ProfilerStep range
    count (the previous step's optimizer kernel before it does not); FSDP's chunk_cat is not one of FLA's chunk_*
    kernels, nor cutlass's grouped GEMM a dense one; the base's families and the per-kernel change follow."""

    def kernel(name, ts, dur):
        return {"name": name, "cat": "kernel", "ts": ts, "dur": dur, "pid": 0, "tid": 7, "args": {"stream": 7}}

    def trace(path, step_start, kernels):
        step = {"name": "ProfilerStep#6", "cat": "gpu_user_annotation", "ts": step_start, "dur": 10_000, "pid": 0,
                "tid": 7}
        path.write_text(json.dumps({"traceEvents": [step, *kernels]}))
        return str(path)

    ours = trace(tmp_path / "ours.json", 1000, [
        kernel("_adam_step", 0, 900),  # the previous step's, before the range: not counted
        kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 1000, 2000),
        kernel("void at::native::detail::chunk_cat_cuda_kernel<float, c10::BFloat16>", 3000, 500),
        kernel("chunk_fwd_kernel_o", 3500, 300), kernel("chunk_fwd_kernel_o", 3800, 300),
        kernel("_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalINS5_17GroupProblemShape", 4100, 1500),
        kernel("_adam_step", 9000, 800)])
    base = trace(tmp_path / "base.json", 0, [
        kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 0, 2000), kernel("chunk_fwd_kernel_o", 2000, 300),
        kernel("_adam_step", 8000, 1600)])
    out = printed_by("tools/trace_breakdown.py", ours, base)
    assert "traced step 10.0 ms on the GPU, kernels 5.4 ms; base 10.0 ms, kernels 3.9 ms" in out
    rows = {line[:24].strip(): line[24:].split() for line in out.splitlines() if line[:1] != " " and "  " in line}
    assert rows["dense GEMMs"] == ["2.00", "1", "2.00", "+0.00"]
    assert rows["grouped GEMMs"] == ["1.50", "1", "0.00", "+1.50"]
    assert rows["FSDP copy-in/out"] == ["0.50", "1", "0.00", "+0.50"]
    assert rows["FLA delta rule"] == ["0.60", "2", "0.30", "+0.30"]
    assert rows["optimizer (FastAdam)"] == ["0.80", "1", "1.60", "-0.80"]
    changes = out.split("kernels that changed most")[1].splitlines()[1:]
    assert changes[0].split() == ["+1.50", changes[0].split()[1]] and "GroupProblemShape" in changes[0]
    assert changes[1].split() == ["-0.80", "_adam_step"]
