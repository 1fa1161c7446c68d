#!/usr/bin/env bash
# Train Qwen3.5-MoE: ./run_train.sh [--config FILE] [--section.key value ...]   (--help lists every key)
#
# With no --config, trains the embedded default (train_configs/debug_model.toml), from any directory. Relative
# input paths in a config file are relative to that file's folder; on the command line and for outputs
# (job.dump_folder), to the directory you run from.
#
# Environment:
#   PYTHON     the interpreter that has the project installed (default: python3 on PATH); a venv's
#              bin/python works without activating the venv.
#   NGPU       processes on this node (default: number of visible CUDA devices, else 1). gloo on CPU, NCCL on GPU.
#   NNODES     nodes in the job (default 1); with NNODES > 1 also set
#   RDZV_ENDPOINT  host:port of the rendezvous (c10d) on node 0, the same on every node, and
#   RDZV_ID    a job id shared by the nodes (default: qwen35). Under SLURM, run this script once per node
#              with RDZV_ENDPOINT=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1):29500.
#   LOG_RANK   ranks whose output is shown (default 0; e.g. 0,1).
# Exit codes: 0 done (or stopped by SIGTERM, saved first), 2 bad input (one `error:` line) or a dump folder another
# run holds, 3 diverged (NaN / inf loss), 130 interrupted (Ctrl-C, or SIGINT sent to this script's process: saved
# first when checkpointing is on).
set -euo pipefail
# SIGINT before the launcher runs: without a trap bash would let the check below (which ends normally) have it,
# and go on to start the launcher
trap 'echo "interrupted while starting; nothing saved" >&2; exit 130' INT
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"

if ! "$PYTHON" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)' 2>/dev/null; then
  echo "error: $PYTHON cannot import torch; install the project into it (pip install -e .) or point PYTHON at the interpreter that has it (e.g. PYTHON=venv/bin/python)" >&2
  exit 2
fi
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
# `python -m` would import from the current directory first: run from inside another checkout (or any folder with a
# harness/ of its own), the launcher and its workers would silently run that code instead of this script's
export PYTHONSAFEPATH=1
exec "$PYTHON" -m harness.launch "$@"
