"""Launching the distributed tests' workers: torchrun on this machine, the repository on the path, one thread a rank."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
            "--rdzv-endpoint=localhost:0"]


def launch(cmd, cwd, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """`cmd` with the repository on the path, one thread a rank and `env` added. A rank left waiting at a collective
    would hang for gloo's 30 minutes: the timeout turns that into a failure."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def run(cmd, cwd, timeout: float = 600, **env: str) -> None:
    """launch, which must succeed."""
    result = launch(cmd, cwd, timeout, **env)
    # The cause (a rank's exception) comes before torchrun's summary, which alone would fill the tail.
    causes = [line for line in result.stderr.splitlines() if "Error" in line or "error:" in line][:10]
    assert result.returncode == 0, "\n".join(causes) + "\n...\n" + result.stdout[-2000:] + result.stderr[-3000:]
