#!/usr/bin/env bash
# Train Qwen3.5-MoE: ./run_train.sh [--config FILE] [--section.key value ...]
#
# With no --config, trains the embedded default (train_configs/debug_model.toml). Relative paths in a
# config (dataset, tokenizer) are relative to the directory you run from; the shipped configs assume
# the repository root.
#
# Environment:
#   NGPU       processes on this node (default: number of CUDA devices, else 1). gloo on CPU, NCCL on GPU.
#   NNODES     nodes in the job (default 1); with NNODES > 1 also set
#   RDZV_ENDPOINT  host:port of the rendezvous (c10d) on node 0, the same on every node, and
#   RDZV_ID    a job id shared by the nodes (default: qwen35). Under SLURM, run this script once per node
#              with RDZV_ENDPOINT=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1):29500.
#   LOG_RANK   ranks whose output is shown (default 0; e.g. 0,1).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

args=("$@")
if [[ " $* " != *" --config "* && " $* " != *" --config="* ]]; then
  args=(--config "$HERE/train_configs/debug_model.toml" "${args[@]}")
fi

NGPU="${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count() or 1)')}"
NNODES="${NNODES:-1}"
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"

exec torchrun --nproc_per_node="$NGPU" --nnodes="$NNODES" \
  --rdzv-backend=c10d --rdzv-endpoint="${RDZV_ENDPOINT:-localhost:0}" --rdzv-id="${RDZV_ID:-qwen35}" \
  --local-ranks-filter="${LOG_RANK:-0}" --role=rank --tee=3 \
  -m harness.train "${args[@]}"
