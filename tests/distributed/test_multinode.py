"""A two-node launch, as run_train.sh does it on a cluster: two launchers (one per "node", both on 127.0.0.1)
meet at one rendezvous endpoint with NNODES=2 and train CP=2 x FSDP=2 over the 4 processes (gloo)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_train_with_context_parallel_and_fsdp(tmp_path):
    env = {**os.environ, "NNODES": "2", "NGPU": "2", "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
           "RDZV_ID": "two-node-test", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    args = [str(REPO / "run_train.sh"), "--training.steps", "2", "--training.seq_len", "64",
            "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false",
            "--parallelism.context_parallel_degree", "2", "--job.dump_folder", str(tmp_path / "out")]
    nodes = [subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [node.communicate(timeout=300) for node in nodes]
    for node, (out, err) in zip(nodes, results):
        assert node.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] > 0 for r in rows)
    summary = "".join(out for out, _ in results)
    assert "done: 2 steps, 512 tokens" in summary  # 2 data-parallel ranks x 2 rows x 64 tokens per step
