"""Variants of the training benchmark run alternately, so that their ratio is measured on one machine at one time.

    python benchmarks/alternate.py --rounds 2 --layers 8 --experts 32 --steps 20 --warmup 8 \\
        --variant "none=--activation_checkpoint.mode none" --variant "full=--activation_checkpoint.mode full" \\
        -- --training.local_batch_size 2 --compile.enable true --training.loss_chunk_tokens 4096

Each round runs every variant once, in order, each in a fresh process (`train_throughput.py`, whose median
tokens/s per device over the steps after `--warmup` is the variant's figure for the round). A variant is
NAME[@GPUS][:TREE]=OVERRIDES: GPUS > 1 runs it under torchrun (FSDP over that many GPUs; the figure is per GPU),
TREE runs another checkout's code (its benchmarks/train_throughput.py, e.g. a `git worktree add /tmp/old COMMIT`),
and OVERRIDES are trainer flags added after the shared ones given after `--`. Code against code:

    python benchmarks/alternate.py --variant main= --variant old:/tmp/old= -- --compile.enable true

The report gives each variant's figures, peak memory and ratio to the first variant, paired round by round, and
how far each variant's losses and gradient norms are from the first variant's run of the same round (all runs start
from the same weights and read the same rows): the largest relative gap of a step's loss from step `--parity-from` on,
the last step's, the last 10 steps' means', and the grad norm's largest and median relative gap. A numerics change
(FP8 against bf16) is read there:

    python benchmarks/alternate.py --rounds 1 --layers 8 --experts 32 --steps 200 --parity-from 50 \
        --variant bf16= --variant "fp8=--quantize.linear_float8_recipe rowwise --quantize.grouped_mm_float8_fqns experts" \
        -- --training.local_batch_size 2 --compile.enable true

Why alternate: the same code runs a few percent apart on two hosts of one kind, and FSDP's ratio to one GPU more
(docs/performance.md, "How to read them" and "FSDP over 2 GPUs against one GPU"), as much as a change worth keeping
gains; pairs run back to back on one host resolve them. Exits non-zero if any run failed.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from bench_model import run_figures  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path("benchmarks") / "train_throughput.py"  # in the variant's tree


@dataclass
class Variant:
    name: str
    gpus: int
    overrides: list[str]
    tree: Path = REPO


def parse_variant(spec: str) -> Variant:
    match = re.fullmatch(r"(?P<name>[\w.+-]+)(@(?P<gpus>\d+))?(:(?P<tree>[^=]+))?=(?P<overrides>.*)", spec)
    if match is None:
        raise SystemExit(f"--variant {spec!r}: expected NAME[@GPUS][:TREE]=OVERRIDES, e.g. 'full=--activation_checkpoint"
                         f".mode full', 'fsdp@2=' or 'old:/tmp/old='")
    gpus = int(match["gpus"] or 1)
    if gpus < 1:
        raise SystemExit(f"--variant {spec!r}: GPUS must be at least 1")
    tree = Path(match["tree"]).resolve() if match["tree"] else REPO
    if not (tree / SCRIPT).is_file():
        raise SystemExit(f"--variant {spec!r}: {tree / SCRIPT} does not exist; TREE must be a checkout of this project")
    return Variant(match["name"], gpus, shlex.split(match["overrides"]), tree)


def alternate(variants: list[Variant], rounds: int, run: Callable[[Variant, int], dict | None]) -> dict[str, list]:
    """{variant name: [figures of round 0, round 1, ...]}, the variants run in order within each round; a failed
    run's figures are None."""
    results = {v.name: [] for v in variants}
    for index in range(rounds):
        for variant in variants:
            results[variant.name].append(run(variant, index))
    return results


def report(variants: list[Variant], results: dict[str, list]) -> list[str]:
    """One line per variant: its tokens/s per device each round, mean, peak memory, and its ratio to the first
    variant's run of the same round."""
    first = results[variants[0].name]
    lines = []
    for variant in variants:
        runs = results[variant.name]
        rates = [r["tokens_per_sec"] if r else None for r in runs]
        shown = " ".join("failed" if t is None else f"{t:,.0f}" for t in rates)
        done = [t for t in rates if t is not None]
        line = f"{variant.name:>12s} ({variant.gpus} rank{'s' if variant.gpus > 1 else ''}): {shown}"
        if done:
            line += f"; mean {statistics.mean(done):,.0f}, peak {max(r['max_memory_gib'] for r in runs if r):.1f} GiB"
        if variant is not variants[0]:
            ratios = [t / b["tokens_per_sec"] for t, b in zip(rates, first) if t is not None and b]
            if ratios:
                line += (f"; vs {variants[0].name}: {' '.join(f'{x:.3f}' for x in ratios)} "
                         f"(mean {statistics.mean(ratios):.3f})")
        lines.append(line)
    return lines


def relative_gaps(base: dict[int, float], other: dict[int, float], from_step: int) -> list[float]:
    """|other - base| / |base| at each step both have from `from_step` on, in step order."""
    return [abs(other[step] - base[step]) / abs(base[step]) for step in sorted(base)
            if step >= from_step and step in other and base[step] != 0]


def parity(variants: list[Variant], results: dict[str, list], from_step: int) -> list[str]:
    """Per variant and round after the first variant: its losses and grad norms against the first variant's run of
    the same round (the module docstring)."""
    lines = []
    for variant in variants[1:]:
        for index, (run, base) in enumerate(zip(results[variant.name], results[variants[0].name])):
            if not run or not base:
                continue
            loss = relative_gaps(base["losses"], run["losses"], from_step)
            norm = relative_gaps(base["grad_norms"], run["grad_norms"], from_step)
            if not loss or not norm:
                continue
            last = max(base["losses"].keys() & run["losses"].keys())
            tail = [step for step in base["losses"].keys() & run["losses"].keys() if step > last - 10 and
                    step >= from_step]
            base_tail = statistics.mean(base["losses"][step] for step in tail)
            run_tail = statistics.mean(run["losses"][step] for step in tail)
            lines.append(f"{variant.name:>12s} vs {variants[0].name} (round {index + 1}), steps {from_step}-{last}: "
                         f"loss gap max {max(loss):.2%}, at step {last} {loss[-1]:.2%}, last {len(tail)} steps' "
                         f"means {abs(run_tail - base_tail) / abs(base_tail):.2%} ({base_tail:.4f} -> {run_tail:.4f}); "
                         f"grad norm gap max {max(norm):.2%}, median {statistics.median(norm):.2%}")
    return lines


def run_curves(metrics: Path) -> dict[str, dict[int, float]]:
    """{losses: {step: loss}, grad_norms: {step: grad norm}} of a run's metrics.jsonl."""
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    return {"losses": {r["step"]: r["loss"] for r in rows}, "grad_norms": {r["step"]: r["grad_norm"] for r in rows}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", required=True, help="NAME[@GPUS]=OVERRIDES (repeat; the first "
                        "is the baseline)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--flavor", default="35B-A3B")
    parser.add_argument("--mtp-layers", type=int, default=0, help="MTP layers of every variant's model")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--parity-from", type=int, default=1, help="first step of the loss and grad-norm comparison")
    parser.add_argument("--work", default=None, help="folder for the runs' output (default: a new temp dir)")
    parser.add_argument("shared", nargs="*", help="trainer overrides for every variant, after --")
    args = parser.parse_args()
    variants = [parse_variant(spec) for spec in args.variant]
    if len({v.name for v in variants}) != len(variants):
        raise SystemExit("--variant names must differ")
    args.work = args.work or tempfile.mkdtemp(prefix="qwen35_alternate_")

    def run(variant: Variant, index: int) -> dict | None:
        work = Path(args.work) / f"{variant.name}-{index}"
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(variant.gpus)]
                    if variant.gpus > 1 else [sys.executable])
        command = [*launcher, str(variant.tree / SCRIPT), "--layers", str(args.layers), "--experts", str(args.experts), "--flavor",
                   args.flavor, *(["--mtp-layers", str(args.mtp_layers)] if args.mtp_layers else []),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--work", str(work), "--",
                   *args.shared, *variant.overrides]
        print(f"round {index + 1}/{args.rounds}: {variant.name}: {shlex.join(command)}", flush=True)
        done = subprocess.run(command, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=variant.tree)
        metrics = work / "out" / "metrics.jsonl"
        figures = run_figures(metrics, args.warmup) if done.returncode == 0 and metrics.exists() else None
        if figures is None:
            print(f"  failed (exit {done.returncode}); its output ended:\n{done.stdout[-2000:]}", flush=True)
        else:
            figures.update(run_curves(metrics))
            mfu = "" if figures["mfu"] is None else f", MFU {figures['mfu']:.1%}"
            print(f"  {figures['tokens_per_sec']:,.0f} tokens/s per device{mfu}, {figures['max_memory_gib']:.1f} GiB",
                  flush=True)
        return figures

    results = alternate(variants, args.rounds, run)
    print("\n".join(report(variants, results) + parity(variants, results, args.parity_from)))
    return 1 if any(r is None for runs in results.values() for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
