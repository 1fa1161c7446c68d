"""Composed meshes on one 4-GPU node: losses against one GPU, tokens/s against two, checkpoints moved between
mesh shapes, and the longest row context parallelism trains (the 4-layer Qwen3.5-35B-A3B-shaped model of
bench_model.py, full activation checkpointing, debug corpus).

    python benchmarks/composed_mesh.py layouts  [--experts 256] [--seq 4096] [--only cp2ep2,...] [--work DIR]
    python benchmarks/composed_mesh.py reshard  [--experts 16]  [--seq 4096] [--work DIR]
    python benchmarks/composed_mesh.py longest  [--experts 16]  [--seq L]
    (layouts, reshard with --flavor debugmodel --experts 8 --seq 256: the same runs as a quick check on CPU, 4 gloo
    processes; longest needs CP=4 to divide the GDN key heads, which the debug model's 2 do not allow)

layouts  Every run takes 4 rows of --seq tokens per optimizer step (global batch 4), so the losses compare step
         by step with one GPU:
           1gpu        one GPU, 2 rows per micro-batch, 2 micro-batches: the reference
           1gpu_accum4 one GPU, 1 row x 4 micro-batches: the same sums in another order, i.e. the bf16 noise level
           dp2cp2ep2   4 GPUs, FSDP over 2 x CP 2, experts split over the CP pair (EP=2)
           hsdp2x2     4 GPUs, 2 replicas x FSDP over 2
         and two 2-GPU runs with the same per-GPU work as a 4-GPU layout (their global batch is 2, so only their
         tokens/s is compared): cp2ep2 for dp2cp2ep2, fsdp2 for hsdp2x2.
reshard  A dp2cp2ep2 run saves at step 3 and exports at step 5; its step-3 checkpoint resumes on 2 GPUs (FSDP=2)
         and on one, each exporting at step 5 (16 experts by default: every save writes 12 B per parameter, and the
         1B-parameter embedding and head already make that 14 GB). Prints the resumed losses against the 4-GPU run's, and the held-out
         loss transformers computes from each export.
longest  CP=2 at --seq and at 2 x --seq (expected not to fit), then CP=4 at 2 x --seq: CP=4 trains the row that is
         too long for CP=2. Default --seq: 512k tokens on 141 GB GPUs, 256k on 80 GB. (Peak memory grows linearly
         with the tokens per GPU, so a CP=4 peak above half the GPU's memory means 4 x --seq cannot fit.)

The 1- and 2-GPU runs of a stage share the node (disjoint GPUs, at the same time); the 4-GPU runs are alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_model import OUT_OF_MEMORY, run_figures, step_losses  # noqa: E402

THROUGHPUT = REPO / "benchmarks" / "train_throughput.py"
FULL_AC = ("--activation_checkpoint.mode", "full")


def flags(dp_shard: int = -1, cp: int = 1, ep: int = 1, replicate: int = 1) -> tuple[str, ...]:
    return ("--parallelism.data_parallel_shard_degree", str(dp_shard), "--parallelism.context_parallel_degree",
            str(cp), "--parallelism.expert_parallel_degree", str(ep), "--parallelism.data_parallel_replicate_degree",
            str(replicate))


class Run:
    """One torchrun of train_throughput.py on the GPUs `gpus` (e.g. "0,1"), its output under work/name."""

    flavor = "35B-A3B"

    def __init__(self, work: Path, name: str, gpus: str, experts: int, steps: int, *overrides: str):
        self.name, self.folder, self.gpus = name, work / name, gpus
        self.folder.mkdir(parents=True, exist_ok=True)
        self.ngpu = len(gpus.split(","))
        self.warmup = min(3, steps - 2)  # steps left out of the figures
        port = 29500 + int(gpus.split(",")[0]) + 10 * self.ngpu
        self.argv = ["torchrun", "--nproc-per-node", str(self.ngpu), "--master-port", str(port), str(THROUGHPUT),
                     "--flavor", self.flavor, "--layers", "4", "--experts", str(experts), "--steps", str(steps),
                     "--warmup", str(self.warmup), "--work", str(self.folder), "--", *FULL_AC, *overrides]
        self.proc = None

    def start(self) -> "Run":
        log = open(self.folder / "log", "w")
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": self.gpus}
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env, text=True)
        return self

    def wait(self) -> int:
        code = self.proc.wait()
        print(f"mesh: {self.name} on GPUs {self.gpus}: exit {code}", flush=True)
        if code != 0:  # the first error lines of any rank: the cause, which torchrun's summary at the end omits
            causes = [line for line in (self.folder / "log").read_text().splitlines()
                      if "Error" in line or "error:" in line or OUT_OF_MEMORY in line]
            print("\n".join(f"mesh:   {line[:300]}" for line in causes[:6]), flush=True)
        return code

    @property
    def out_of_memory(self) -> bool:
        """Whether a rank ran out of memory (torchrun's own exit code is 1 whatever the ranks' were)."""
        return OUT_OF_MEMORY in (self.folder / "log").read_text()

    @property
    def out(self) -> Path:
        return self.folder / "out"

    def losses(self) -> dict[int, float]:
        """{step: loss}; empty if the run logged no step."""
        path = self.out / "metrics.jsonl"
        return step_losses(path) if path.exists() else {}

    def figures(self) -> dict | None:
        path = self.out / "metrics.jsonl"
        return run_figures(path, self.warmup) if path.exists() else None


def stage(*runs: Run) -> list[int]:
    """Start the runs together (they use disjoint GPUs) and wait for all."""
    for run in runs:
        run.start()
    return [run.wait() for run in runs]


def largest_gap(a: dict[int, float], b: dict[int, float]) -> float:
    return max(abs(a[s] - b[s]) for s in a if s in b)


def layouts(work: Path, experts: int, seq: int, only: set[str] | None) -> None:
    steps, batch = 10, ("--training.seq_len", str(seq), "--training.global_batch_size", "4")
    one = Run(work, "1gpu", "0", experts, steps, *batch, "--training.local_batch_size", "2")
    accum = Run(work, "1gpu_accum4", "1", experts, steps, *batch, "--training.local_batch_size", "1")
    fsdp2 = Run(work, "fsdp2", "2,3", experts, steps, "--training.seq_len", str(seq), "--training.local_batch_size", "1")
    cp2ep2 = Run(work, "cp2ep2", "2,3", experts, steps, "--training.seq_len", str(seq),
                 "--training.local_batch_size", "2", *flags(cp=2, ep=2))
    composed = Run(work, "dp2cp2ep2", "0,1,2,3", experts, steps, *batch, "--training.local_batch_size", "2",
                   *flags(dp_shard=2, cp=2, ep=2))
    hsdp = Run(work, "hsdp2x2", "0,1,2,3", experts, steps, *batch, "--training.local_batch_size", "1",
               *flags(dp_shard=2, replicate=2))
    runs = [r for r in (one, accum, fsdp2, cp2ep2, composed, hsdp) if only is None or r.name in only]
    singles = [r.start() for r in runs if r.ngpu == 1]  # on GPUs 0 and 1, while the pairs run on 2 and 3
    for run in (r for r in runs if r.ngpu == 2):
        stage(run)
    for run in singles:
        run.wait()
    for run in (r for r in runs if r.ngpu == 4):  # the whole node, alone
        stage(run)

    ran = {r.name: got for r in runs if (got := r.losses())}
    print(f"mesh: layouts, 4 layers, {experts} experts, 4 rows x {seq} tokens per step, full AC, {steps} steps")
    print("mesh: step         " + " ".join(f"{s:>8}" for s in range(1, steps + 1)))
    for name, got in ran.items():
        if name in ("1gpu", "1gpu_accum4", "dp2cp2ep2", "hsdp2x2"):  # the global-batch-4 runs
            print(f"mesh: {name:<12}" + " ".join(f"{got.get(s, float('nan')):8.4f}" for s in range(1, steps + 1)))
    reference = ran.get("1gpu")
    for name in ("1gpu_accum4", "dp2cp2ep2", "hsdp2x2"):
        if reference and name in ran:
            print(f"mesh: {name} vs 1gpu: step-1 |d| {abs(ran[name][1] - reference[1]):.2e}, largest |d| "
                  f"{largest_gap(ran[name], reference):.2e}")
    for run in runs:
        fig = run.figures() if run.name in ran else None
        mfu = "n/a" if not fig or fig["mfu"] is None else f"{fig['mfu']:.1%}"
        print(f"mesh: {run.name:<12} tokens/s per GPU {fig['tokens_per_sec']:>8,.0f}  MFU {mfu}  "
              f"peak {fig['max_memory_gib']:.1f} GiB" if fig else f"mesh: {run.name}: no figures")
    for four, two in ((composed, cp2ep2), (hsdp, fsdp2)):
        if four.name in ran and two.name in ran:
            a, b = four.figures(), two.figures()
            print(f"mesh: {four.name} / {two.name} tokens/s per GPU: {a['tokens_per_sec'] / b['tokens_per_sec']:.3f}")


def held_out_loss(hf_folder: Path, tokens: int) -> float:
    """transformers' mean next-token loss of an exported folder on the corpus's last documents."""
    import torch
    from transformers import AutoModelForCausalLM

    from harness.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    ids: list[int] = []
    for line in reversed((REPO / "data" / "debug_corpus" / "train.jsonl").read_text().splitlines()):
        ids = [tok.bos_id, *tok.encode(json.loads(line)["text"])] + ids
        if len(ids) >= tokens:
            break
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch = torch.tensor([ids[-tokens:]], device=device)
    model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.bfloat16).to(device).eval()
    with torch.no_grad():
        return model(input_ids=batch, labels=batch).loss.item()


def reshard(work: Path, experts: int, seq: int) -> None:
    ckpt = ("--training.seq_len", str(seq), "--training.global_batch_size", "2", "--checkpoint.enable", "true",
            "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0", "--checkpoint.export_hf_at_end", "true")
    steps, after = 5, (4, 5)
    saved = Run(work, "saved_dp2cp2ep2", "0,1,2,3", experts, steps, *ckpt, "--training.local_batch_size", "1",
                *flags(dp_shard=2, cp=2, ep=2))
    stage(saved)
    resumed = []
    for name, gpus, local in (("resumed_fsdp2", "0,1", "1"), ("resumed_1gpu", "2", "2")):
        run = Run(work, name, gpus, experts, steps, *ckpt, "--training.local_batch_size", local)
        # The 4-GPU run's folder up to step 3: checkpoint shards as hard links (read only; no copy of GBs), the
        # small files (metrics.jsonl, config) as copies, which the resumed run rewrites.
        shutil.copytree(saved.out, run.out, ignore=shutil.ignore_patterns(f"step-{steps}", "hf"),
                        copy_function=lambda a, b: os.link(a, b) if os.path.getsize(a) > 2**20 else shutil.copy2(a, b))
        resumed.append(run)
    stage(*resumed)
    want = saved.losses()
    print(f"mesh: reshard, 4 layers, {experts} experts, 2 rows x {seq} per step; saved at step 3 by dp2cp2ep2")
    for run in resumed:
        text = (run.folder / "log").read_text()
        got = run.losses()
        note = next((line.strip() for line in text.splitlines() if "resumed by" in line), "NO RESHARD LINE")
        print(f"mesh: {run.name}: {note[-150:]}")
        print(f"mesh: {run.name} steps {after} " + " ".join(f"{got.get(s, float('nan')):.4f}" for s in after)
              + "  vs 4 GPUs " + " ".join(f"{want[s]:.4f}" for s in after)
              + f"  largest |d| {max(abs(got.get(s, float('nan')) - want[s]) for s in after):.2e}")
    for run in (saved, *resumed):
        hf = run.out / "hf"
        size = sum(f.stat().st_size for f in hf.glob("*.safetensors")) / 2**30
        print(f"mesh: {run.name} export {size:.2f} GiB, transformers held-out loss {held_out_loss(hf, seq):.4f}", flush=True)


def longest(work: Path, experts: int, seq: int) -> None:
    # The debug corpus holds ~972k tokens, fewer than one 1M-token row: repeat it enough for a 2 x seq row.
    corpus = (REPO / "data" / "debug_corpus" / "train.jsonl").read_text()
    repeated = work / "corpus.jsonl"
    repeated.write_text(corpus * (2 * seq // 900_000 + 1))

    def cp_run(cp: int, length: int, gpus: str) -> Run:
        name = f"cp{cp}_{length // 1024}k" if length % 1024 == 0 else f"cp{cp}_{length}"  # one folder per run
        return Run(work, name, gpus, experts, 3, "--training.seq_len", str(length),
                   "--training.local_batch_size", "1", "--training.dataset_path", str(repeated), *flags(cp=cp))

    print(f"mesh: longest row, 4 layers, {experts} experts, full AC, 1 row per step")
    runs = [cp_run(2, seq, "0,1"), cp_run(2, 2 * seq, "2,3")]
    codes = stage(*runs)
    runs.append(cp_run(4, 2 * seq, "0,1,2,3"))
    codes += stage(runs[-1])
    for run, code in zip(runs, codes):
        fig = run.figures() if code == 0 else None
        print(f"mesh: {run.name:<10} " + (f"trains: tokens/s per GPU {fig['tokens_per_sec']:,.0f}, peak "
                                         f"{fig['max_memory_gib']:.1f} GiB" if fig else
                                         "out of memory" if run.out_of_memory else f"FAILED (exit {code}, cause above)"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["layouts", "reshard", "longest"])
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None,
                        help="tokens per row (layouts, reshard: 4096); longest: CP=2's row (default by GPU memory)")
    parser.add_argument("--flavor", default="35B-A3B", help="layer shapes (debugmodel: a quick check on CPU)")
    parser.add_argument("--work", default=None)
    parser.add_argument("--only", default=None, help="layouts: a comma-separated subset of the runs, e.g. cp2ep2,dp2cp2ep2")
    ns = parser.parse_args()
    work = Path(ns.work or tempfile.mkdtemp(prefix=f"qwen35_{ns.what}_"))
    work.mkdir(parents=True, exist_ok=True)
    Run.flavor = ns.flavor
    smi = shutil.which("nvidia-smi") and subprocess.run(
        ["nvidia-smi", "-i", "0", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
        capture_output=True, text=True).stdout
    big = bool(smi) and int(smi.split()[0]) > 120_000  # MiB: a 141 GB card
    if ns.what == "layouts":  # one GPU holds 256 experts' states (69 GB) only on 141 GB cards
        layouts(work, ns.experts or (256 if big else 128), ns.seq or 4096,
                set(ns.only.split(",")) if ns.only else None)
    elif ns.what == "reshard":
        reshard(work, ns.experts or 16, ns.seq or 4096)
    else:
        longest(work, ns.experts or 16, ns.seq or (2**19 if big else 2**18))
    return 0


if __name__ == "__main__":
    sys.exit(main())
