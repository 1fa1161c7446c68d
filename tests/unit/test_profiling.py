"""`[profiling]`: a trace of every profile_freq-th training step per rank, on the steps of the run (also after a
resume), and the op table in the log; benchmarks/tools/trace_host.py reads the trace.
(The benchmarks/ trace readers on hand-made traces: tests/benchmarks.)"""

from __future__ import annotations

import json
from pathlib import Path

from harness.train import main
from tests.benchmarks.scripts import printed_by

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
    host = printed_by("tools/trace_host.py", str(traces / "iteration_6" / "rank0_trace.json"))
    assert "up to the backward" in host and "(optimizer.step " in host and "(optimizer.step 0.0 ms)" not in host

    # Resumed at step 4 (the last step of a 4-step run), the next traced step is still 6.
    resumed = tmp_path / "resumed"
    assert main([*ARGS, "--training.steps", "4", "--job.dump_folder", str(resumed),
                 "--checkpoint.enable", "true", "--checkpoint.interval", "4"]) == 0
    assert main([*ARGS, "--training.steps", "6", "--job.dump_folder", str(resumed),
                 "--checkpoint.enable", "true", "--checkpoint.interval", "4"]) == 0
    assert sorted(p.name for p in (resumed / "profile_traces").iterdir()) == ["iteration_3", "iteration_6"]
