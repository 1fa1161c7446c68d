"""FSDP2 data parallelism on 2 CPU ranks (gloo) against one process on the same global batch."""

import os
import subprocess
import sys
from pathlib import Path

import torch

from models.qwen35_moe import get_flavor, save_hf_checkpoint
from tests.builders import initialized_model

REPO = Path(__file__).resolve().parents[2]
WORKER = str(REPO / "tests" / "distributed" / "fsdp_step_worker.py")


def _run(cmd, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_fsdp_two_ranks_matches_single_process(tmp_path):
    model = initialized_model(get_flavor("debugmodel"))
    save_hf_checkpoint(model.state_dict(), model.args, tmp_path / "init", dtype=torch.float32)
    init = str(tmp_path / "init")

    _run([sys.executable, WORKER, str(tmp_path / "single.pt"), init], tmp_path)
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
          "--rdzv-endpoint=localhost:0", WORKER, str(tmp_path / "fsdp.pt"), init], tmp_path)
    single, fsdp = torch.load(tmp_path / "single.pt"), torch.load(tmp_path / "fsdp.pt")
    # Same fp32 math, different reduction order (per-rank partial sums + all-reduce): ~1e-7 relative.
    assert abs(fsdp["out"]["loss"] - single["out"]["loss"]) < 1e-5 * single["out"]["loss"]
    assert abs(fsdp["out"]["grad_norm"] - single["out"]["grad_norm"]) < 1e-4 * single["out"]["grad_norm"]
    assert fsdp["grads"].keys() == single["grads"].keys()
    for name, ref in single["grads"].items():
        rel = ((fsdp["grads"][name] - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert rel < 1e-4, f"{name}: relative grad difference {rel:.2e}"
