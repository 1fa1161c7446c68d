"""benchmarks/gpu_power.py: nvidia-smi's samples summarized per GPU."""

from __future__ import annotations

from tests.benchmarks.scripts import loaded


def test_gpu_power_summary_counts_busy_samples_only():
    """benchmarks/gpu_power.py on hand-written nvidia-smi samples (its query's columns, no header or units): per GPU,
    the means over the samples drawing at least 40% of the power limit, and the share of them capped by power;
    idle, unreadable and malformed lines are left out."""
    gpu_power = loaded("gpu_power.py")
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
