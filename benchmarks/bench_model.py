"""The model the benchmarks train, and how they run the trainer on it.

The real 35B-A3B does not fit a GPU or two with fp32 master weights and AdamW states, so the benchmarks keep every
layer width of a flavor (hidden 2048, GDN 16/32 heads of 128, attention 16/2 heads of 256, expert and shared
intermediate 512, top-8 routing, vocab 248,320 for 35B-A3B) and cut only the depth and the expert count.
They train it on the debug corpus with the byte tokenizer, from fresh weights, logging every step.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from models.qwen35_moe import Qwen35MoeArgs, get_flavor

REPO = Path(__file__).resolve().parents[1]


def bench_args(layers: int, experts: int, flavor: str = "35B-A3B", mtp_layers: int = 0) -> Qwen35MoeArgs:
    """`flavor`'s layer widths with `layers` decoder layers (the flavor's hybrid pattern), `experts` experts and
    `mtp_layers` MTP layers (none by default, so that figures compare with those of models without them)."""
    base = get_flavor(flavor)
    return Qwen35MoeArgs(**{**vars(base), "num_hidden_layers": layers, "layer_types": None, "num_experts": experts,
                            "mtp_num_hidden_layers": mtp_layers})


def trainer_argv(hf_config: Path, dump_folder: Path, steps: int) -> list[str]:
    """Trainer flags for the model in `hf_config` (a config.json of bench_args) on the debug corpus; a benchmark
    adds its checkpoint, export and parallelism flags. The run's log lines are named after the model it trains
    (bench_<layers>L_<experts>E_h<hidden>), not after qwen35_moe.toml's 35B-A3B job."""
    config = json.loads(Path(hf_config).read_text())
    name = f"bench_{config['num_hidden_layers']}L_{config['num_experts']}E_h{config['hidden_size']}"
    return [
        "--config", str(REPO / "train_configs" / "qwen35_moe.toml"), "--job.name", name,
        "--model.hf_config", str(hf_config), "--model.tokenizer_path", "",
        "--training.dataset_source", "jsonl",
        "--training.dataset_path", str(REPO / "data" / "debug_corpus" / "train.jsonl"),
        "--checkpoint.initial_load_hf", "", "--training.steps", str(steps), "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup_steps", "2",
        "--job.dump_folder", str(dump_folder),
        # qwen35_moe.toml splits the experts over 8 GPUs; a benchmark runs on 1-4 (add the flag again to use EP)
        "--parallelism.expert_parallel_degree", "1",
    ]


OUT_OF_MEMORY = "bench: out of memory"  # train_throughput.py's line for a rank that ran out; composed_mesh reads it


def step_losses(metrics: Path) -> dict[int, float]:
    """{step: training loss} of a run's metrics.jsonl (validation records carry val_loss instead)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def run_figures(metrics: Path, warmup: int) -> dict | None:
    """Medians over a run's steps after `warmup` (metrics.jsonl): tokens/s per device and MFU (None on CPU), and
    the peak memory and last loss of the run; None if no step was timed. Also the spread of those steps' rates:
    their harmonic mean (the rate over their total time) and their lowest and highest. Runs of the same code on
    2 GPUs differ by several percent in median (docs/performance.md, "FSDP over 2 GPUs against one GPU"), so
    report more than one run."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    timed = [r for r in rows if r["step"] > warmup]
    if not timed:
        return None
    mfu = [r["mfu"] for r in timed if r["mfu"] is not None]
    rates = [r["tokens_per_sec"] for r in timed]
    return {"tokens_per_sec": statistics.median(rates), "steps": len(rates),
            "harmonic_tokens_per_sec": statistics.harmonic_mean(rates), "range": (min(rates), max(rates)),
            "mfu": statistics.median(mfu) if mfu else None,
            "max_memory_gib": max(r["max_memory_gib"] for r in rows), "final_loss": rows[-1]["loss"]}


def cuda_median_ms(fn: Callable[[], object], repeats: int, warmup: int = 3,
                   before: Callable[[], object] | None = None) -> float:
    """Median milliseconds of fn() on the GPU (CUDA events) over `repeats` calls after `warmup`; `before()` runs
    ahead of each call, untimed (a barrier, so that ranks start together)."""
    times = []
    for i in range(warmup + repeats):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)
