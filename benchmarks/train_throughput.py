"""Training throughput and MFU of Qwen3.5-35B-A3B-shaped layers on the GPUs at hand.

The model keeps every layer shape of 35B-A3B and shrinks only the depth (one hybrid block of 3 GDN + 1 attention
layers by default) and the expert count (bench_model.py). Per-token FLOPs and the kernels per layer are those of
the full model, the routed-expert GEMMs are smaller groups.

    python benchmarks/train_throughput.py --layers 4 --experts 64 -- --training.seq_len 4096 ...
    torchrun --nproc-per-node 2 benchmarks/train_throughput.py --work /tmp/cp2 -- \
        --parallelism.context_parallel_degree 2 --training.seq_len 32768

Prints the median tokens/s per GPU, MFU and peak memory over the steps after warm-up, the spread of those steps'
rates, and the GPUs' power draw and SM clocks over the run (gpu_power.py) (rank 0). Under torchrun give every
rank the same --work folder. A run that does not fit prints "bench: out of memory" and exits 3.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from bench_model import OUT_OF_MEMORY, bench_args, run_figures, trainer_argv  # noqa: E402
from gpu_power import PowerSampler  # noqa: E402

from harness.config import load_config  # noqa: E402
from harness.train import main  # noqa: E402


def main_bench() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--flavor", default="35B-A3B", help="layer shapes (debugmodel: a quick check on CPU)")
    parser.add_argument("--mtp-layers", type=int, default=0, help="MTP layers (trained with training.mtp_loss_coef)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from the figures")
    parser.add_argument("--work", default=None, help="folder for the config and run output (default: a new temp dir)")
    parser.add_argument("overrides", nargs="*", help="trainer overrides, after --")
    ns = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))

    args = bench_args(ns.layers, ns.experts, ns.flavor, ns.mtp_layers)
    work = Path(ns.work or tempfile.mkdtemp(prefix="qwen35_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    (work / f"config.{rank}.json").write_text(json.dumps(args.to_hf_config()))
    argv = [*trainer_argv(work / f"config.{rank}.json", work / "out", ns.steps), "--checkpoint.enable", "false",
            "--checkpoint.export_hf_at_end", "false", *ns.overrides]
    power = PowerSampler() if rank == 0 else None  # nvidia-smi sees every GPU of the host
    try:
        with power or contextlib.nullcontext():
            code = main(argv)
    except (torch.OutOfMemoryError, RuntimeError) as err:
        # Out of memory also reaches us as a RuntimeError (NCCL's or a kernel launch's buffers): any text that
        # says so counts. Exit at once: torchrun then stops the other ranks, which would otherwise wait in a
        # collective.
        if not isinstance(err, torch.OutOfMemoryError) and "out of memory" not in str(err).lower():
            raise
        print(f"{OUT_OF_MEMORY} (rank {rank}) overrides={' '.join(ns.overrides)}: {str(err)[:200]}", flush=True)
        os._exit(3)
    if rank != 0 or code != 0:
        return code
    figures = run_figures(Path(load_config(argv).job.dump_folder) / "metrics.jsonl", ns.warmup)  # yours, if given
    if figures is None:
        return 1
    tps, mfu = figures["tokens_per_sec"], figures["mfu"]
    print(f"bench: layers={ns.layers} experts={ns.experts} overrides={' '.join(ns.overrides)}")
    print(f"bench: median tokens/s per device {tps:,.0f}  MFU {'n/a' if mfu is None else f'{mfu:.1%}'}")
    low, high = figures["range"]
    print(f"bench: {figures['steps']} steps timed: harmonic mean {figures['harmonic_tokens_per_sec']:,.0f} tokens/s, "
          f"per step {low:,.0f}-{high:,.0f}")
    print(f"bench: peak memory {figures['max_memory_gib']:.1f} GiB  final loss {figures['final_loss']:.3f}")
    for line in power.summary():  # the whole run's busy samples, compile included
        print(f"bench: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main_bench())
