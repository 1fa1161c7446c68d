"""benchmarks/fsdp_unit_host.py runs on CPU (a fake process group: collectives as no-ops) and prints each of its
figures, FSDP2's profile included."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_prints_every_figure_on_cpu():
    env = {**os.environ, "FAKE_PG": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fsdp_unit_host.py"), "--iters", "2",
                             "--profile"], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = {name: float(ms) for ms, name in
               re.findall(r"fsdp_unit_host rank 0: +([0-9.]+) ms  (.+?)  \(18 parameters", result.stdout)}
    assert sorted(figures) == sorted([
        "unsharded (fwd + bwd, no FSDP)", "fsdp2 (fwd + bwd)", "fsdp2 unshard + reshard",
        "fsdp2, two blocks a unit, per block (fwd + bwd)", "floor: 1 all-gather + 1 split copy",
        "floor: 1 _chunk_cat + 1 reduce-scatter"]), result.stdout
    assert all(ms > 0 for ms in figures.values()), figures
    assert "FSDP::post_backward_reduce" in result.stdout  # the profile's table
