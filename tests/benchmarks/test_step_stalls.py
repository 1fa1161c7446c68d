"""benchmarks/tools/step_stalls.py: each step's line counts what happened in that step only."""

from __future__ import annotations

import logging

from torch._dynamo.utils import counters

from tests.benchmarks.scripts import BENCHMARKS, loaded, printed_by


def test_a_step_line_counts_the_events_between_its_start_and_the_next(capsys):
    stalls = loaded("tools/step_stalls.py")
    steps = stalls.StepCounters()
    recompiles = stalls._Recompiles(steps)
    steps.begin(1)
    counters["stats"]["unique_graphs"] += 2
    steps.triton_compiled(key="k", repr="chunk_fwd_kernel_o[num_warps=4, num_ctas=1](q: *bf16, T: i32, H: constexpr)",
                          fn=None, compile={}, is_manual_warmup=False, already_compiled=False)
    recompiles.emit(logging.LogRecord("torch._dynamo", logging.DEBUG, "", 0,
                                      "    - 2/0: tensor 'cu_seqlens' size mismatch at index 0. expected 6, actual 5",
                                      None, None))
    steps.gc_callback("start", {})
    steps.gc_callback("stop", {})
    steps.begin(2)
    steps.begin(3)
    lines = capsys.readouterr().out.splitlines()
    first = next(line for line in lines if "step   1" in line)
    assert "dynamo graphs 2" in first and "triton compiles 1 (chunk_fwd_kernel_o)" in first and "gc 1" in first
    assert any("cu_seqlens' size mismatch" in line for line in lines)
    assert any("triton chunk_fwd_kernel_o(T: i32)" in line for line in lines)
    second = next(line for line in lines if "step   2" in line)
    assert "dynamo graphs 0" in second and "triton compiles 0" in second and "gc 0" in second


def test_it_runs_a_training_script_and_reports_every_step():
    out = printed_by("tools/step_stalls.py", str(BENCHMARKS / "train_throughput.py"), "--flavor", "debugmodel",
                     "--layers", "2", "--experts", "4", "--steps", "3", "--warmup", "1",
                     "--", "--training.seq_len", "64", "--training.local_batch_size", "2")
    assert [line.split()[2] for line in out.splitlines() if line.startswith("stalls: step")] == ["1", "2", "3"]
