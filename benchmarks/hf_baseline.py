"""Our trainer against a plain transformers training loop on the same shapes and batches, in one process.

    python benchmarks/hf_baseline.py --layers 8 --experts 32 -- --training.local_batch_size 2 \
        --activation_checkpoint.mode none
    python benchmarks/hf_baseline.py --layers 4 --experts 64 -- --training.local_batch_size 2 \
        --activation_checkpoint.mode none

The baseline is what a user would write without this project: transformers' `Qwen3_5MoeForCausalLM` with the
35B-A3B widths (depth and expert count cut to fit one GPU), bf16 weights, grouped_mm experts, FLA's kernels for
Gated DeltaNet where FLA is installed (transformers picks them up itself), SDPA attention, AdamW, loss from
`labels`. It gets the rows our data pipeline gives our trainer (as plain rows: transformers' own loop knows
nothing of our packing). Ours runs `harness.train` on `train_configs/qwen35_moe.toml` with the same shapes
(fp32 master weights, bf16 compute, chunked cross entropy) and any trainer overrides given after `--`.

Prints tokens/s per GPU, MFU and peak memory of each (medians over the steps after warm-up) and the ratio.
`--variant "OVERRIDES"` (repeatable) runs ours again with those overrides added, in the same process, each
against the same baseline run, e.g. the activation checkpointing modes:

    python benchmarks/hf_baseline.py --variant "--activation_checkpoint.mode full" -- --compile.enable true
`--flavor debugmodel` runs the same on CPU in seconds (a check of the script, not a benchmark).
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_model import bench_args, run_figures, trainer_argv  # noqa: E402
from gpu_power import PowerSampler  # noqa: E402

from harness.config import load_config  # noqa: E402
from harness.data.loader import build_dataloader  # noqa: E402
from harness.metrics import max_memory_gib, mean_attended_keys, peak_flops  # noqa: E402
from harness.train import main as train_main  # noqa: E402
from models.qwen35_moe import Qwen35MoeArgs  # noqa: E402
from models.qwen35_moe.flops import training_flops_per_token  # noqa: E402


def transformers_model(args: Qwen35MoeArgs, device: torch.device, folder: Path | None = None):
    """transformers' Qwen3_5MoeForCausalLM as the baseline runs it: `args`' shapes with fresh weights, or the
    weights of the HF folder `folder`; bf16 on a GPU (grouped_mm experts), fp32 on CPU; SDPA attention."""
    from transformers import AutoConfig, Qwen3_5MoeForCausalLM

    from models.qwen35_moe.kernels.fla_hopper_guard import enable_fla_hopper_backward

    if device.type == "cuda":  # FLA refuses its backward on Hopper with Triton < 3.7.1 unless this self-check passes
        enable_fla_hopper_backward(args.linear_num_key_heads, args.linear_num_value_heads,
                                   args.linear_key_head_dim, args.linear_value_head_dim, device)
    options = {"dtype": torch.bfloat16 if device.type == "cuda" else torch.float32, "attn_implementation": "sdpa",
               "experts_implementation": "grouped_mm" if device.type == "cuda" else None}
    if folder is None:
        with torch.device(device):
            model = Qwen3_5MoeForCausalLM._from_config(AutoConfig.for_model(**args.to_hf_config()), **options)
    else:
        # loaded on the host, then moved: a device_map would need accelerate, which the plain loop does without
        model = Qwen3_5MoeForCausalLM.from_pretrained(folder, **options).to(device)
    model.train()
    return model


def train_loop(model, optimizer, batches: list[dict], device: torch.device, warmup: int, loss_of,
               max_norm: float | None = None, scheduler=None) -> dict:
    """Trains `model` on `batches`, one optimizer step each; `loss_of(model, batch)` is a step's loss, the batch
    on the device. Returns median tokens/s after `warmup` steps, peak memory and every step's loss and rate."""
    rates, losses = [], []
    for i, batch in enumerate(batches):
        batch = {key: value.to(device) for key, value in batch.items()}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = loss_of(model, batch)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            rates.append(batch["input_ids"].numel() / (time.perf_counter() - start))
        losses.append(loss.item())
    return {"tokens_per_sec": statistics.median(rates), "max_memory_gib": max_memory_gib(device),
            "final_loss": losses[-1], "losses": losses, "rates": rates}


def run_baseline(args: Qwen35MoeArgs, batches: list[dict], device: torch.device, warmup: int) -> dict:
    """A plain transformers loop over `batches`; returns median tokens/s and peak memory after warm-up."""
    model = transformers_model(args, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1, betas=(0.9, 0.95))

    def loss_of(model, batch):
        ids = batch["input_ids"]
        return model(input_ids=ids, labels=ids).loss  # transformers shifts the labels itself

    result = train_loop(model, optimizer, batches, device, warmup, loss_of)
    del model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return result


def run_ours(argv: list[str], warmup: int) -> dict:
    if train_main(argv) != 0:
        raise SystemExit("our trainer failed")
    # A --job.dump_folder given in the overrides wins over the script's.
    result = run_figures(Path(load_config(argv).job.dump_folder) / "metrics.jsonl", warmup)
    # The next run starts clean: its own compile (a new model would otherwise count towards the recompile limit
    # of the same code) and its own memory peak.
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from the figures")
    parser.add_argument("--flavor", default="35B-A3B", help="layer widths (debugmodel: a quick check on CPU)")
    parser.add_argument("--variant", action="append", default=[], metavar="OVERRIDES",
                        help="run ours again with these overrides added (repeatable)")
    parser.add_argument("overrides", nargs="*", help="trainer overrides, after --")
    ns = parser.parse_args()
    args = bench_args(ns.layers, ns.experts, ns.flavor)
    work = Path(tempfile.mkdtemp(prefix="qwen35_hf_baseline_"))
    (work / "config.json").write_text(json.dumps(args.to_hf_config()))
    argv = [*trainer_argv(work / "config.json", work / "out", ns.steps), "--checkpoint.enable", "false",
            "--checkpoint.export_hf_at_end", "false", "--training.dataset_cache_dir", str(work / "cache"),
            *ns.overrides]
    cfg = load_config(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from harness.data.tokenizer import build_tokenizer

    t = cfg.training
    loader = build_dataloader(t.dataset_source, t.dataset_path, t.dataset_text_field,
                              build_tokenizer(cfg.model.tokenizer_path), t.seq_len, t.local_batch_size, dp_rank=0,
                              dp_world_size=1, cache_dir=str(work / "cache"))
    batches = [batch for _, batch in zip(range(ns.steps), loader)]

    def powered(run, *run_args):  # the run's figures, and the GPU's power and clocks over it (gpu_power.py)
        with PowerSampler() as power:
            result = run(*run_args)
        return {**result, "power": power.summary()}

    baseline = powered(run_baseline, args, batches, device, ns.warmup)
    runs = [("ours", powered(run_ours, argv, ns.warmup))]
    for i, variant in enumerate(ns.variant, 1):
        extra = ["--job.dump_folder", f"{cfg.job.dump_folder}-variant{i}", *shlex.split(variant)]
        runs.append((f"ours {variant}", powered(run_ours, [*argv, *extra], ns.warmup)))
    # Both are credited with the same useful work: attention within documents (the baseline attends across them).
    attended = sum(mean_attended_keys(b["position_ids"]) for b in batches) / len(batches)
    flops, peak = training_flops_per_token(args, attended), peak_flops(device)
    print(f"baseline vs ours: {ns.flavor} widths, {ns.layers} layers, {ns.experts} experts, seq {t.seq_len}, "
          f"local batch {t.local_batch_size}, {ns.steps} steps (first {ns.warmup} not timed), {device}")
    for name, r in (("transformers loop", baseline), *runs):
        mfu = f"{r['tokens_per_sec'] * flops / peak:.1%}" if peak else "n/a"
        print(f"  {name:18s} {r['tokens_per_sec']:>10,.0f} tok/s  MFU {mfu:>6s}  peak {r['max_memory_gib']:.1f} GiB  "
              f"final loss {r['final_loss']:.3f}")
        for line in r["power"]:
            print(f"  {'':18s} {line}")
    for name, r in runs:
        print(f"  ratio ({name} / transformers): {r['tokens_per_sec'] / baseline['tokens_per_sec']:.2f}x")
    print("  transformers loop, tok/s per timed step:", " ".join(f"{rate:,.0f}" for rate in baseline["rates"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
