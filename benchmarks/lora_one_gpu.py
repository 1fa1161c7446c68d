"""LoRA fine-tuning of the full-size Qwen3.5-35B-A3B on one GPU, as train_configs/qwen35_moe_lora.toml runs it, from a
folder shaped like the release (scripts/make_release_checkpoint.py writes one with random weights where the release
cannot be downloaded): the time to load the base, the first step (compile), tokens/s and MFU after warm-up, the
peak memory against benchmarks/memory_model.py's prediction, the checkpoint's size and save time, and the end-of-run
export's time and size (the merged model, and the PEFT adapter).

    python scripts/make_release_checkpoint.py /dev/shm/base --device cuda
    python benchmarks/lora_one_gpu.py --base /dev/shm/base --work /dev/shm/lora [--delete-base-after-load]
    python benchmarks/lora_one_gpu.py --base /dev/shm/base --work /dev/shm/lora80 \
        --config train_configs/qwen35_moe_lora_80gb.toml              # the one-80-GB-card config

`--memory-cap-gib 46` caps the trainer's GPU memory with torch.cuda.set_per_process_memory_fraction (a 48 GB card's
stand-in). A base in the FP8 release's layout (`make_release_checkpoint.py --fp8`) is held in FP8 by the trainer,
and predicted so (with `-- --lora.fp8_base dequantized`, in bf16: the same values, a bf16 base's baseline).
`--long-chats` trains on multi-turn conversations of 1-4k tokens (scripts/make_long_chat.py) instead of the debug
corpus's short ones, so attention and Gated DeltaNet see documents as long as users'. `--delete-base-after-load`
removes the base folder once the first step has run (the base is in GPU memory by then): on a host whose memory file
system holds the base or the export but not both. Trainer flags go after `--`.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from memory_model import Setup, predict_gib  # noqa: E402

from harness.config import load_config  # noqa: E402
from harness.memory_check import fp8_base_held  # noqa: E402
from models.qwen35_moe import get_flavor  # noqa: E402

# The trainer's log lines this script reads (tests/benchmarks/test_lora_one_gpu.py holds them to a run's log)
BUILT = r"\] model (?:flavor )?\S+: [\d.]+M parameters"  # "model flavor NAME: ..." or "model CONFIG_PATH: ..."
FIRST_STEP = r"step +1/"
SAVED = r"checkpoint step-\d+ saved to .* \(training held up ([\d.]+) s\)"
EXPORTED = r"\] exported (\S+)(?: and \S+)? in ([\d.]+) s"  # hf/ (and the adapter)
GPU_MEMORY_BUILT = r"GPU memory with the model built: ([\d.]+) GiB"  # a GPU run's only


def folder_gib(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1024**3


def chat_rows(path: Path, long: bool, base: Path) -> Path:
    """Chat conversations as JSON lines: short ones (the debug corpus's tasks, under 100 tokens), or `long` ones of
    1-4k tokens each counted with the base's tokenizer, as users' are."""
    if long:
        command = ["make_long_chat.py", "--tokenizer", str(base), "--train", "400", "--val", "10"]
    else:
        command = ["make_debug_chat.py", "--train", "20000", "--val", "10"]
    made = subprocess.run([sys.executable, str(REPO / "scripts" / command[0]), *command[1:], "--out", str(path)],
                          check=True, capture_output=True, text=True)
    print(f"bench: {made.stdout.splitlines()[0]}", flush=True)
    return path / "train.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True, help="the release-shaped HF folder (weights, tokenizer)")
    parser.add_argument("--work", required=True, help="dump folder of the run (its checkpoint and export)")
    parser.add_argument("--config", default=str(REPO / "train_configs" / "qwen35_moe_lora.toml"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--delete-base-after-load", action="store_true")
    parser.add_argument("--long-chats", action="store_true", help="conversations of 1-4k tokens, not under 100")
    parser.add_argument("--memory-cap-gib", type=float, help="cap the trainer's GPU memory (a 48 GB card: 46)")
    parser.add_argument("trainer_flags", nargs="*")
    ns = parser.parse_args()
    work, base = Path(ns.work), Path(ns.base)
    data = chat_rows(work.parent / (work.name + "-data"), ns.long_chats, base)
    # --memory-cap-gib: the trainer's process may allocate no more on the GPU (a smaller card's stand-in)
    capped = ("import sys, torch; torch.cuda.set_per_process_memory_fraction({:.6f}); from harness.train import main; "
              "sys.exit(main(sys.argv[1:]))")
    launch = ["-m", "harness.train"] if ns.memory_cap_gib is None else ["-c", capped.format(
        ns.memory_cap_gib * 1024**3 / torch.cuda.get_device_properties(0).total_memory)]
    argv = [sys.executable, *launch, "--config", ns.config,
            "--model.tokenizer_path", str(base), "--checkpoint.initial_load_hf", str(base),
            "--training.dataset_path", str(data), "--training.steps", str(ns.steps),
            "--checkpoint.interval", str(ns.steps), "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
            "--job.dump_folder", str(work), *ns.trainer_flags]
    started = time.perf_counter()
    marks: dict[str, float] = {}
    lines = []
    with subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as run:
        for line in run.stdout:
            print(line, end="", flush=True)
            lines.append(line)
            now = time.perf_counter() - started
            if re.search(BUILT, line):
                marks.setdefault("built", now)  # the base loaded into the model
            if re.search(FIRST_STEP, line):
                marks.setdefault("first_step", now)
                if ns.delete_base_after_load and any(base.glob("*.safetensors")):
                    for shard in base.glob("*.safetensors"):  # the tokenizer stays: checkpoints and exports copy it
                        shard.unlink()
                    print(f"bench: deleted the weights of {base} (they are in GPU memory)", flush=True)
    if run.returncode:
        print(f"bench: the run failed (exit {run.returncode})")
        return run.returncode
    records = [json.loads(r) for r in (work / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and r["step"] > ns.warmup]
    text = "".join(lines)
    saved = re.findall(SAVED, text)
    exported = re.findall(EXPORTED, text)
    rate = sorted(r["tokens_per_sec"] for r in steps)[len(steps) // 2] if steps else float("nan")
    mfu = sorted(r.get("mfu") or 0 for r in steps)[len(steps) // 2] if steps else float("nan")
    peak = max(r["max_memory_gib"] for r in records if "loss" in r)
    reserved = max(r.get("max_reserved_gib", float("nan")) for r in records if "loss" in r)
    cfg = load_config(["--config", ns.config, "--checkpoint.initial_load_hf", str(base), *ns.trainer_flags])
    setup = Setup(gpus=1, lora_rank=cfg.lora.rank, expert_rank=cfg.lora.expert_rank,
                  local_batch=cfg.training.local_batch_size,
                  accumulate=cfg.training.global_batch_size > cfg.training.local_batch_size,
                  loss_chunk=cfg.training.loss_chunk_tokens,
                  fp8_base=fp8_base_held(cfg))
    predicted = predict_gib(get_flavor("35B-A3B"), setup)
    built = re.findall(GPU_MEMORY_BUILT, text)
    print(f"bench: base loaded and model built {marks.get('built', float('nan')):.0f} s after start; first step done "
          f"at {marks.get('first_step', float('nan')):.0f} s")
    print(f"bench: {rate:,.0f} tokens/s (median of steps {ns.warmup + 1}-{ns.steps}), MFU {mfu:.1%}, peak "
          f"{peak:.1f} GiB allocated, {reserved:.1f} GiB reserved (memory model, {setup}: {predicted:.1f} GiB); "
          f"{built[0] if built else '?'} GiB allocated once the model was built")
    checkpoint = work / "checkpoint" / f"step-{ns.steps}"
    if checkpoint.is_dir():
        held_up = saved[-1] if saved else "?"
        print(f"bench: checkpoint {folder_gib(checkpoint):.2f} GiB, save held training up {held_up} s")
    for folder, seconds in exported:
        print(f"bench: export {folder}: {folder_gib(Path(folder)):.1f} GiB in {seconds} s")
    adapter = work / "hf-adapter"
    if adapter.is_dir():
        print(f"bench: PEFT adapter {adapter}: {folder_gib(adapter):.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
