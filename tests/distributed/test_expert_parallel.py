"""Expert parallelism's dispatches (all-to-all, all-gather) on 2 and 4 gloo ranks against the whole MoE layer in one
process (tests/distributed/expert_parallel_worker.py): outputs, input gradients, router, shared-expert and
local-expert gradients in float64, with a rank whose tokens never reach the other ranks' experts."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_exchange_equals_the_whole_layer(ep, tmp_path):
    # Inductor compiles in the worker's own process (the compiled case): one CI run under load aborted a rank with
    # "terminate called without an active exception"; inductor's pool of compile workers is a suspect, not proven.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ep}", "--rdzv-backend=c10d",
           "--rdzv-endpoint=localhost:0", str(REPO / "tests" / "distributed" / "expert_parallel_worker.py")]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
