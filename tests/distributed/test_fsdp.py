"""FSDP2 (and HSDP) data parallelism on 2 CPU ranks (gloo) against one process, through the trainer and the real
data pipeline: the same seed gives the same initial weights, and the same global batch gives the same loss, MoE
balance loss and gradients, whatever the number of ranks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.builders import fp32_grad_tolerance

REPO = Path(__file__).resolve().parents[2]
WORKER = str(REPO / "tests" / "distributed" / "fsdp_step_worker.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
            "--rdzv-endpoint=localhost:0"]


def run(cmd, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    run([sys.executable, WORKER, str(tmp / "single.pt")], tmp)
    return tmp, torch.load(tmp / "single.pt")


@pytest.mark.parametrize("layout", [[], ["--parallelism.data_parallel_replicate_degree", "2"]], ids=["fsdp", "hsdp"])
def test_two_ranks_match_single_process(single, layout):
    tmp, ref = single
    name = "hsdp" if layout else "fsdp"
    run([*TORCHRUN, WORKER, str(tmp / f"{name}.pt"), *layout], tmp)
    got = torch.load(tmp / f"{name}.pt")

    # Initial weights depend on the seed only, not on the world size or mesh: bitwise equal.
    assert got["initial"].keys() == ref["initial"].keys()
    for key, value in ref["initial"].items():
        assert torch.equal(got["initial"][key], value), key

    # Same fp32 math, other summation order (per-rank partial sums + all-reduce): ~1e-7 relative.
    assert got["validation"]["val_tokens"] == ref["validation"]["val_tokens"]
    assert got["validation"]["val_loss"] == pytest.approx(ref["validation"]["val_loss"], rel=1e-6)
    for key in ("loss", "aux_loss", "grad_norm"):
        assert got["out"][key] == pytest.approx(ref["out"][key], rel=1e-5), key
    assert ref["out"]["aux_loss"] > 1.0  # the balance loss was on (a uniform router gives top_k = 2)
    for key, want in ref["grads"].items():
        rel = ((got["grads"][key] - want).norm() / want.norm().clamp_min(1e-12)).item()
        assert rel < fp32_grad_tolerance(key), f"{key}: relative grad difference {rel:.2e}"
    router = [k for k in ref["grads"] if k.endswith("mlp.gate.weight")]
    assert router and all(((got["grads"][k] - ref["grads"][k]).norm() / ref["grads"][k].norm()) < 1e-5 for k in router)
