"""`[profiling]`: a trace of every profile_freq-th training step per rank, on the steps of the run (also after a
resume), and the op table in the log."""

from __future__ import annotations

import json
from pathlib import Path

from harness.train import main

REPO = Path(__file__).resolve().parents[2]
ARGS = ["--config", str(REPO / "train_configs" / "debug_model.toml"), "--training.seq_len", "64",
        "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false",
        "--training.dataset_path", str(REPO / "data" / "debug_corpus" / "train.jsonl"),
        "--profiling.enable_profiling", "true", "--profiling.profile_freq", "3"]


def test_traces_land_on_the_training_steps_that_are_multiples_of_profile_freq(tmp_path, capsys):
    out = tmp_path / "out"
    assert main([*ARGS, "--training.steps", "6", "--job.dump_folder", str(out)]) == 0
    log = capsys.readouterr().err
    traces = out / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_3", "iteration_6"]
    trace = json.loads((traces / "iteration_6" / "rank0_trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names or "aten::addmm" in names  # the model's matmuls were recorded
    assert "profiled step 6" in log and "Self CPU" in log  # the op table
    # The host-side reader finds the trainer's step range, its backward and optimizer, with today's profiler names.
    import subprocess
    import sys

    host = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tools" / "trace_host.py"),
                           str(traces / "iteration_6" / "rank0_trace.json")],
                          capture_output=True, text=True, check=True).stdout
    assert "up to the backward" in host and "(optimizer.step " in host and "(optimizer.step 0.0 ms)" not in host

    # Resumed at step 4 (the last step of a 4-step run), the next traced step is still 6.
    resumed = tmp_path / "resumed"
    assert main([*ARGS, "--training.steps", "4", "--job.dump_folder", str(resumed),
                 "--checkpoint.enable", "true", "--checkpoint.interval", "4"]) == 0
    assert main([*ARGS, "--training.steps", "6", "--job.dump_folder", str(resumed),
                 "--checkpoint.enable", "true", "--checkpoint.interval", "4"]) == 0
    assert sorted(p.name for p in (resumed / "profile_traces").iterdir()) == ["iteration_3", "iteration_6"]


def test_trace_gaps_counts_idle_time_once_over_streams_and_names_the_launching_op(tmp_path):
    """benchmarks/tools/trace_gaps.py on a hand-made trace: kernels on two streams overlap (busy counted once), and the
    idle time before a kernel goes to the host ops around its launch."""
    import subprocess
    import sys

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
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tools" / "trace_gaps.py"), str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert "GPU busy 0.6 ms of 1.0 ms traced; idle 0.4 ms in 1 gaps" in out
    assert "0.40 ms  Optimizer.step#FastAdam.step > cudaLaunchKernel" in out


def test_trace_gaps_splits_the_compute_streams_idle_time_by_whether_a_collective_ran(tmp_path):
    """benchmarks/tools/trace_gaps.py's compute-stream view on a hand-made gzipped trace: stream 7 (the most kernels)
    idles 0.5 ms while an NCCL kernel on stream 9 runs across the gap (FSDP's compute waiting on a gather; the
    GPU-wide view counts it busy) and 0.3 ms with no collective (waiting on the host); a 0.1 ms gap is below
    --min-gap 0.2 and not counted."""
    import gzip
    import subprocess
    import sys

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
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tools" / "trace_gaps.py"), str(path),
                          "--min-gap", "0.2"], capture_output=True, text=True, check=True).stdout
    assert ("compute stream 7: idle 0.8 ms in 2 gaps of >= 0.2 ms: 0.5 ms while a collective ran, 0.3 ms with "
            "none") in out
    assert "0.50 ms at     0.1 ms, before gemm; collectives: ncclDevKernel_AllGather_RING_LL (0.60 ms)" in out
    assert "0.30 ms at     0.7 ms, before norm; collectives: none" in out


def test_trace_gaps_counts_only_the_traced_steps_kernels(tmp_path):
    """benchmarks/tools/trace_gaps.py with the GPU's ProfilerStep range in the trace: the previous step's last kernel,
    which ran before the range, and the idle time after it are not this step's."""
    import subprocess
    import sys

    def kernel(name, ts, dur):
        return {"name": name, "cat": "kernel", "ts": ts, "dur": dur, "pid": 0, "tid": 7, "args": {"stream": 7}}

    step = {"name": "ProfilerStep#6", "cat": "gpu_user_annotation", "ts": 1000, "dur": 1000, "pid": 0, "tid": 7}
    events = [step, kernel("_adam_step", 0, 300),  # the previous step's, 700 us before the range
              kernel("gemm", 1000, 200), kernel("norm", 1300, 200)]  # 100 us idle between them
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tools" / "trace_gaps.py"), str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert "GPU busy 0.4 ms of 0.5 ms traced; idle 0.1 ms in 1 gaps" in out


def test_trace_breakdown_counts_the_traced_steps_kernels_by_family_and_the_change_against_a_base(tmp_path):
    """benchmarks/tools/trace_breakdown.py on two hand-made traces: only kernels inside the GPU's ProfilerStep range
    count (the previous step's optimizer kernel before it does not); FSDP's chunk_cat is not one of FLA's chunk_*
    kernels, nor cutlass's grouped GEMM a dense one; the base's families and the per-kernel change follow."""
    import subprocess
    import sys

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
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tools" / "trace_breakdown.py"), ours, base],
                         capture_output=True, text=True, check=True).stdout
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


def test_gpu_power_summary_counts_busy_samples_only():
    """benchmarks/gpu_power.py on hand-written nvidia-smi samples (its query's columns, no header or units): per GPU,
    the means over the samples drawing at least 40% of the power limit, and the share of them capped by power;
    idle, unreadable and malformed lines are left out."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_power", REPO / "benchmarks" / "gpu_power.py")
    gpu_power = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_power)
    lines = ["0, 1980, 1980, 120.5, 700.00, Not Active",  # idle: left out
             "0, 1700, 1980, 690.0, 700.00, Active",
             "0, 1600, 1980, 700.0, 700.00, Active",
             "0, 1900, 1980, 500.0, 700.00, Not Active",
             "1, 1800, 1980, [N/A], 700.00, Not Active",  # unreadable: left out
             "1, 1500, 1980, 650.0, 700.00, Active",
             "garbage"]
    assert gpu_power.summarize(lines) == [
        "GPU 0: 3 busy samples: SM clock 1,733 of 1,980 MHz, power 630 of 700 W, power cap active in 67%",
        "GPU 1: 1 busy samples: SM clock 1,500 of 1,980 MHz, power 650 of 700 W, power cap active in 100%"]
    assert gpu_power.summarize(lines[:1]) == []
    with gpu_power.PowerSampler() as power:  # without nvidia-smi (CPU CI): nothing sampled, nothing printed
        pass
    assert power.summary() == [] or all(line.startswith("GPU ") for line in power.summary())


def test_trace_host_splits_the_steps_host_time_and_names_waits_hooks_and_exclusive_time(tmp_path):
    """benchmarks/tools/trace_host.py on a hand-made trace: the step's host range (100 ms; the GPU's starts 20 ms later)
    split at the first and last backward op (on the autograd thread, 2); the wait in a gloo collective and the
    sync after the step; FSDP's outermost hooks only (the all-gather nested in pre_forward is not counted twice);
    exclusive times with children taken out (chunk_cat's 4 ms less its 0.5 ms allocation); an op after the step
    is not the step's, nor is the GPU's range of the step before."""
    import subprocess
    import sys

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
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tools" / "trace_host.py"), str(path), "--top", "3"],
                         capture_output=True, text=True, check=True).stdout
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
