"""The launcher behind run_train.sh: validate the config, then start the worker(s) and exit with their code.

    python -m harness.launch [--config FILE] [--section.key value ...]      (no --config: the embedded default)

- A bad config fails here, before any worker starts: one `error:` line, exit 2, in a fraction of a second
  (nothing heavier than the config and the models' plain-Python flavors is imported).
- One process in all (NGPU=1, NNODES=1): the worker runs in this process, with its own exit code.
- Otherwise torchrun starts NGPU workers per node. Worker output passes through as it comes; torchrun's own
  lines are held back and shown only when a worker failed without saying why (a crash). A worker that stops
  for a known reason (2 bad input, 3 divergence, 0 SIGTERM, 130 Ctrl-C) leaves its code in QWEN35_EXIT_DIR
  and the launcher exits with it, after the worker's one line, without torchrun's traceback.
- CPU runs get their threads chosen, unless OMP_NUM_THREADS / OMP_WAIT_POLICY are set: the usable cores
  split evenly over this node's processes, and OpenMP threads that sleep rather than spin while they wait
  (`cpu_thread_settings`).
Environment: NGPU (processes per node; default: the visible GPUs, else 1), NNODES, RDZV_ENDPOINT, RDZV_ID,
LOG_RANK (ranks whose output is shown, default 0).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from .config import ConfigError, with_default_config
from .preflight import check_launch
from .train import BAD_INPUT, INTERRUPTED, STARTING

def visible_gpus() -> int:
    """GPUs this process may use, counted without importing torch (CUDA_VISIBLE_DEVICES, else the driver's list)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    driver = Path("/proc/driver/nvidia/gpus")
    return len(list(driver.iterdir())) if driver.is_dir() else 0


def cpu_thread_settings(procs_per_node: int, environ: dict[str, str]) -> dict[str, str]:
    """OpenMP settings for CPU workers, where `environ` does not set them already.

    All usable cores, shared by the node's processes, waiting passively: spinning threads are a little faster on an
    idle host and far slower when another process keeps a core busy (docs/performance.md, "Start-up and CPU"); one
    thread is slower on an idle host ("Tried, not kept")."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    settings = {"OMP_NUM_THREADS": str(max(1, cores // procs_per_node)), "OMP_WAIT_POLICY": "PASSIVE"}
    return {k: v for k, v in settings.items() if k not in environ}


def main(argv: list[str] | None = None) -> int:
    argv = with_default_config(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        from .config_help import config_help

        print(config_help(argv))
        return 0
    nproc = int(os.environ.get("NGPU") or visible_gpus() or 1)
    nnodes = int(os.environ.get("NNODES", "1"))
    try:
        check_launch(argv, nproc * nnodes)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return BAD_INPUT
    if visible_gpus() == 0:  # before torch loads OpenMP, here or in the workers (who inherit the environment)
        os.environ.update(cpu_thread_settings(nproc, os.environ))
    if nproc * nnodes == 1:
        from .train import main as train

        return train(argv)
    return run_torchrun(argv, nproc, nnodes)


def run_torchrun(argv: list[str], nproc: int, nnodes: int) -> int:
    exit_dir = tempfile.mkdtemp(prefix="qwen35-exit-")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--nnodes={nnodes}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint={os.environ.get('RDZV_ENDPOINT', 'localhost:0')}",
           f"--rdzv-id={os.environ.get('RDZV_ID', 'qwen35')}", f"--local-ranks-filter={os.environ.get('LOG_RANK', '0')}",
           "--role=rank", "--tee=3", "-m", "harness.train", *argv]
    env = {**os.environ, "QWEN35_EXIT_DIR": exit_dir}
    held = []  # torchrun's own stderr lines: its traceback after a worker fails, start-up warnings
    try:
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, bufsize=1)
        # Ctrl-C reaches torchrun and the workers too (one process group): they stop, save and say so; keep
        # relaying their lines meanwhile. A SIGTERM sent to this launcher alone is passed on to torchrun.
        signal.signal(signal.SIGINT, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
        for line in proc.stderr:
            if line.startswith("[rank"):  # a worker's line, tee'd by torchrun
                sys.stderr.write(line)
            else:
                held.append(line)
        returncode = proc.wait()
        codes = [int(p.read_text()) for p in Path(exit_dir).iterdir()]
    finally:
        shutil.rmtree(exit_dir, ignore_errors=True)
    if returncode != 0 and codes:  # the workers stopped for a known reason (torchrun reports any stop as failed)
        return max(codes)  # every rank reports the same reason; the larger code wins if they differ
    if returncode != 0:
        sys.stderr.writelines(held)
    return returncode


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C before a worker has its own handler: one line, no traceback
        print(STARTING, file=sys.stderr)
        sys.exit(INTERRUPTED)
