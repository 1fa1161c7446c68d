"""Training throughput and MFU of Qwen3.5-35B-A3B-shaped layers on the GPUs at hand.

The real 35B model does not fit one GPU with fp32 master weights and Adam states, so this keeps every
layer shape of 35B-A3B (hidden 2048, GDN 16/32 heads of 128, attention 16/2 heads of 256, expert and
shared intermediate 512, top-8 routing, vocab 248320) and shrinks only the depth (one hybrid block of 3 GDN
+ 1 attention layers by default) and the expert count. Per-token FLOPs and the kernels per layer are those of
the full model, the routed-expert GEMMs are smaller groups.

    python benchmarks/train_throughput.py --layers 4 --experts 64 -- --training.seq_len 4096 ...
    torchrun --nproc-per-node 2 benchmarks/train_throughput.py --work /tmp/cp2 -- \
        --parallelism.context_parallel_degree 2 --training.seq_len 32768

Prints the median tokens/s per GPU, MFU and peak memory over the steps after warm-up (rank 0). Under torchrun
give every rank the same --work folder. A run that does not fit prints "bench: out of memory" and exits 3.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from harness.train import main  # noqa: E402
from models.qwen35_moe import Qwen35MoeArgs, get_flavor  # noqa: E402


def main_bench() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from the figures")
    parser.add_argument("--work", default=None, help="folder for the config and run output (default: a new temp dir)")
    parser.add_argument("overrides", nargs="*", help="trainer overrides, after --")
    ns = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))

    base = get_flavor("35B-A3B")
    args = Qwen35MoeArgs(**{**vars(base), "num_hidden_layers": ns.layers, "layer_types": None,
                            "num_experts": ns.experts})
    work = Path(ns.work or tempfile.mkdtemp(prefix="qwen35_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    (work / f"config.{rank}.json").write_text(json.dumps(args.to_hf_config()))
    argv = [
        "--config", str(REPO / "train_configs" / "qwen35_moe.toml"),
        "--model.hf_config", str(work / f"config.{rank}.json"), "--model.tokenizer_path", "",
        "--training.dataset", "jsonl", "--training.dataset_path", str(REPO / "data" / "debug_corpus" / "train.jsonl"),
        "--checkpoint.enable", "false", "--checkpoint.initial_load_hf", "", "--checkpoint.export_hf_at_end", "false",
        "--training.steps", str(ns.steps), "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--lr_scheduler.warmup_steps", "2", "--job.dump_folder", str(work / "out"), *ns.overrides,
    ]
    try:
        code = main(argv)
    except torch.OutOfMemoryError:
        # Exit at once: torchrun then stops the other ranks, which would otherwise wait in a collective.
        print(f"bench: out of memory (rank {rank}) overrides={' '.join(ns.overrides)}", flush=True)
        os._exit(3)
    if rank != 0:
        return code
    rows = [json.loads(line) for line in (work / "out" / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r["step"] > ns.warmup]
    if code != 0 or not timed:
        return code or 1
    tps = statistics.median(r["tokens_per_sec"] for r in timed)
    mfu = [r["mfu"] for r in timed if r["mfu"] is not None]
    print(f"bench: layers={ns.layers} experts={ns.experts} overrides={' '.join(ns.overrides)}")
    print(f"bench: median tokens/s per device {tps:,.0f}  MFU {statistics.median(mfu):.1%}" if mfu else
          f"bench: median tokens/s per device {tps:,.0f}  MFU n/a")
    print(f"bench: peak memory {max(r['max_memory_gib'] for r in rows):.1f} GiB  final loss {rows[-1]['loss']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main_bench())
