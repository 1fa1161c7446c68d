"""Save, preempt, resume and export the 4-layer Qwen3.5-35B-A3B-shaped model through run_train.sh on the GPUs at
hand (NGPU, default: all visible), and print what it cost.

    python benchmarks/checkpoint_cycle.py [--layers 4] [--experts 64] [--seq 4096] [--work DIR]

Four launches into separate dump folders, every one saving at steps 3, 6 and 9:
  sync     10 steps, synchronous saves: the reference curve, and the time each save holds training up
  async    10 steps, async_mode = "async": the stall per save when the write overlaps training
  killed   the same as sync, SIGTERM to every process of the job once step 5 is logged: must exit 0 having saved
  resumed  the relaunch into the killed run's folder: must resume at its save, finish, and export HF weights
Prints the stalls, the preempted save's step, the resumed losses against the reference (GPU kernels are not
bitwise deterministic, so the figure is the largest difference) and the export's time and size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_model import bench_args, step_losses, trainer_argv  # noqa: E402

STEPS, INTERVAL, KILL_AFTER = 10, 3, 5


def launch(work: Path, name: str, *extra: str) -> subprocess.Popen:
    argv = [str(REPO / "run_train.sh"), *trainer_argv(work / "config.json", work / name, STEPS),
            "--checkpoint.enable", "true", "--checkpoint.interval", str(INTERVAL), "--checkpoint.keep_latest_k", "1",
            *extra]
    log = open(work / f"{name}.log", "w")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, process_group=0, text=True)


def finish(proc: subprocess.Popen, name: str) -> None:
    code = proc.wait(timeout=1800)
    if code != 0:
        raise SystemExit(f"{name}: exit code {code}")


def log_text(work: Path, name: str) -> str:
    return (work / f"{name}.log").read_text()


def stalls(text: str) -> list[float]:
    return [float(s) for s in re.findall(r"training held up ([0-9.]+) s", text)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--work", default=None)
    parser.add_argument("--flavor", default="35B-A3B", help="layer shapes (debugmodel: a quick check on CPU)")
    ns = parser.parse_args()
    work = Path(ns.work or tempfile.mkdtemp(prefix="qwen35_ckpt_"))
    work.mkdir(parents=True, exist_ok=True)
    args = bench_args(ns.layers, ns.experts, ns.flavor)
    (work / "config.json").write_text(json.dumps(args.to_hf_config()))
    common = ("--training.seq_len", str(ns.seq), "--checkpoint.export_hf_at_end", "false")

    finish(launch(work, "sync", *common), "sync")
    finish(launch(work, "async", *common, "--checkpoint.async_mode", "async"), "async")

    killed = launch(work, "killed", *common)
    metrics = work / "killed" / "metrics.jsonl"
    while killed.poll() is None:  # SIGTERM to the whole job once step KILL_AFTER is logged, as SLURM does
        if metrics.exists() and any(json.loads(line).get("step", 0) >= KILL_AFTER
                                    for line in metrics.read_text().splitlines() if line.strip()):
            os.killpg(killed.pid, signal.SIGTERM)
            break
        subprocess.run(["sleep", "0.2"])
    finish(killed, "killed")
    saved = sorted(int(p.name.split("-")[1]) for p in (work / "killed" / "checkpoint").glob("step-*")
                   if p.name.split("-")[1].isdigit())
    finish(launch(work, "resumed", "--training.seq_len", str(ns.seq), "--checkpoint.export_hf_at_end", "true",
                  "--job.dump_folder", str(work / "killed")), "resumed")
    resumed_text = log_text(work, "resumed")
    resumed_at = re.search(r"resumed from checkpoint \S+ \(step (\d+)\)", resumed_text)
    export = re.search(r"exported Hugging Face checkpoint to \S+ in ([0-9.]+) s", resumed_text)

    reference, after = step_losses(work / "sync" / "metrics.jsonl"), step_losses(work / "killed" / "metrics.jsonl")
    diffs = {s: abs(after[s] - reference[s]) for s in reference if s in after}
    hf = work / "killed" / "hf"
    hf_bytes = sum(f.stat().st_size for f in hf.glob("*.safetensors"))
    index = (hf / "model.safetensors.index.json").exists()
    gpus = os.environ.get("NGPU", "all visible")
    print(f"ckpt: {ns.flavor} shape, {ns.layers} layers, {ns.experts} experts, seq {ns.seq}, NGPU {gpus}, saves every "
          f"{INTERVAL} steps, {STEPS} steps")
    print(f"ckpt: sync save stalls (s):  {stalls(log_text(work, 'sync'))}  median "
          f"{statistics.median(stalls(log_text(work, 'sync'))):.2f}")
    print(f"ckpt: async save stalls (s): {stalls(log_text(work, 'async'))}  median "
          f"{statistics.median(stalls(log_text(work, 'async'))):.2f}")
    print(f"ckpt: SIGTERM after step {KILL_AFTER}: exit 0, checkpoints kept {saved}; relaunch resumed at step "
          f"{resumed_at.group(1) if resumed_at else 'NOT FOUND'} and finished step {max(after)}")
    print(f"ckpt: resumed vs uninterrupted loss, largest |difference| over steps "
          f"{min(diffs)}..{max(diffs)}: {max(diffs.values()):.2e} (final {after[STEPS]:.4f} vs {reference[STEPS]:.4f})")
    print(f"ckpt: HF export {export.group(1) if export else 'NOT FOUND'} s, {hf_bytes / 2**30:.2f} GiB in "
          f"{len(list(hf.glob('*.safetensors')))} files, index {'present' if index else 'absent'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
