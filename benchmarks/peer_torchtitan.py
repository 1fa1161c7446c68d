"""Our trainer against torchtitan 0.3.0's own Qwen3.5-MoE and a plain transformers loop: the same shapes, rows and
initial weights, each contender in a fresh process of its own (its own compile, its own memory peak). With
`--lora RANK`, our LoRA trainer against the same transformers loop with PEFT's LoRA, from the same adapters.

    python benchmarks/peer_torchtitan.py --layers 8 --experts 32 --batch 2 --ac none
    python benchmarks/peer_torchtitan.py --layers 4 --experts 256 --batch 8 --ac full --only ours,torchtitan
    python benchmarks/peer_torchtitan.py --layers 4 --experts 256 --batch 8 --ac none --float8
    python benchmarks/peer_torchtitan.py --layers 8 --experts 32 --batch 2 --ac none --lora 16 --only ours,peft \
        --steps 20 --warmup 5
    python benchmarks/peer_torchtitan.py --layers 4 --experts 256 --batch 4 --ac full --lora 16 --only ours,peft \
        --steps 20 --warmup 5
    python benchmarks/peer_torchtitan.py --flavor debugmodel --layers 4 --experts 8 --seq 256 --steps 3 --warmup 1
    python benchmarks/peer_torchtitan.py --flavor debugmodel --layers 4 --experts 8 --seq 256 --steps 3 --warmup 1 \
        --lora 8 --only ours,peft

The last two run on CPU in well under a minute: checks of the script, not benchmarks (torchtitan's FLA and
FlexAttention kernels, GPU only, are replaced there by plain PyTorch references, and it says so). With `--work DIR`
the rows and initial weights made there are reused by a later invocation of the same model and rows, and the
results of contenders run there earlier with the same settings are reported beside those just run: one contender
per invocation (`--only ours`, then `--only torchtitan`, then `--only transformers`) each within a time limit.
FLA_CACHE_MODE / FLA_CONFIG_DIR (benchmarks/fla_configs, tuned for FLA 0.6) reach every contender but torchtitan.

torchtitan runs on packages of its own, installed once into a folder that goes first on the PYTHONPATH of its
process alone (`--torchtitan-site`): torchtitan 0.3.0 imports `fla.modules.conv.triton.ops`, which fla-core 0.5.2
has and 0.6.0 (ours, and transformers') does not. From the repository root:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_tt .whl_tt/*.whl

`.whl_tt/` (not in git; made with shared/tools/make_wheelhouse.sh for CPython 3.12) holds torchtitan 0.3.0 and what
its model, parallelize, compile, activation checkpointing, loss and optimizer modules import beyond torch, numpy and
safetensors: spmd_types 0.2.3, fla-core 0.5.2, tyro 1.0.17, docstring_parser 0.18.0, einops 0.8.2, packaging 26.4
and typing_extensions 4.16.0. FLA imports Triton, which a CPU build of torch lacks: for the CPU check add
triton==3.6.0 to that folder. torchtitan 0.3.0 follows torch's nightly builds: on torch 2.11 three stand-ins fill
what it uses and torch lacks (add_torch_stand_ins; the output names those set), one of them FSDP2's chunked-loss fix
(torch >= 2.13): without it lm_head's fp32-accumulated gradient and the final norm's bf16 one reach one reduce, which
FSDP2 refuses; the stand-in casts the bf16 one to fp32 first, as FSDP2 does when it reduces in fp32 (the same values),
and on torch 2.11 six of the eight loss chunks sum their lm_head gradients in bf16 before FSDP2's fp32 accumulator.

What each contender runs for `--steps` optimizer steps of `--batch` rows of `--seq` tokens, on one device:
- ours: `harness.train` on train_configs/qwen35_moe.toml (fp32 master weights, bf16 compute, chunked cross entropy)
  with the AC mode and compile flag given and any trainer overrides after `--` (`--training.aux_loss_coef 0` drops
  the MoE balance loss, which the other two do not train with); it reads the corpus itself and every batch it draws
  is checked equal to the saved rows. Its tokens/s are its own per-step figures (metrics.jsonl).
- torchtitan: its Qwen3.5 model from its own 35B-A3B layer builder at our widths (text only, no expert-bias load
  balancing), parallelized as `parallelize_qwen3_5` does it on one GPU, by its own functions: AC, per-block compile,
  FSDP2 (which it applies on one GPU too, on a one-rank mesh, for its mixed precision: fp32 parameters, bf16 compute,
  fp32 gradients); its chunked cross entropy, its fused AdamW (`OptimizersContainer`), its gradient clipping, its
  document masking (FlexAttention block mask, GDN state and conv reset per document). Its blocks compile with graph
  breaks around FLA's kernels, and before they are checkpointed (parallelize_one_gpu says why;
  `--torchtitan-compile as-is` runs parallelize_qwen3_5 as it is). Its compiled frames read the document boundaries
  as a Python tuple and compile again for each new document count; past dynamo's recompile_limit (torch's 8 unless
  `--torchtitan-recompile-limit`) they run uncompiled, which the output notes, as it notes the graphs compiled
  inside timed steps and the slowest timed step. Where else this differs from its trainer, the code says why.
- transformers: hf_baseline.py's loop (bf16 weights and AdamW states, grouped_mm experts, SDPA, FLA through
  transformers, not compiled; AC as gradient checkpointing per decoder layer) on plain rows: it attends across
  documents.
All three start from one HF folder of our model's initial weights, train on the same saved batches with our labels
and our optimizer settings: AdamW lr, betas, eps, weight decay on matrices only, our warm-up and decay schedule,
gradient clipping at training.max_norm. torchtitan and transformers are timed per step around the whole step.

FP8 mode (`--float8`; the contenders are ours and torchtitan, the transformers loop has no FP8 training): float8
training with dynamic rowwise scales in both, torchao's recipe in both, on the same modules:
- ours: `--quantize.linear_float8_recipe rowwise --quantize.grouped_mm_float8_fqns experts` (harness/float8.py): the
  blocks' projections but lm_head, shared_expert_gate and the Gated DeltaNet's in_proj_a / in_proj_b (our default
  filter; the router is no Linear), and the routed experts' grouped GEMMs, their token groups laid out at 16-row
  starts in the layer. On CPU with `--quantize.float8_emulate true` (a check of the script).
- torchtitan: its own converters as its float8 model configs apply them, before the model is built:
  Float8LinearConverter (recipe rowwise, `filter_fqns` naming the same modules by its names: lm_head, router.gate,
  shared_experts.gate, in_proj_a, in_proj_b) and Float8GroupedExpertsConverter (torchao's Float8TrainingOpConfig on
  the grouped experts; its token dispatcher pads each expert's group to 16 rows). Both need an SM89+ GPU: on CPU it
  fails at the converter, and the report shows that.

LoRA mode (`--lora RANK`, `--lora-expert-rank` our lora.expert_rank, `--lora-alpha`, default twice the rank; the
contenders are ours and peft):
- ours: as above with `--lora.enable true --lora.rank --lora.expert_rank --lora.alpha` (our default targets: the
  attention and Gated DeltaNet projections, the shared and the routed experts; MTP frozen): the frozen base in bf16
  on a GPU, fp32 adapters.
- peft: the transformers contender's model (bf16 on a GPU, fp32 on CPU), loop and rows, its base frozen, with
  `peft.PeftModel.from_pretrained(model, folder, is_trainable=True)` on a PEFT folder that holds our initial adapters:
  our model with LoRA is built and drawn from the run's seed as our trainer does it (harness/model_setup.py), on the
  contenders' device (CPU and CUDA generators draw different numbers), and written by harness/lora/peft.py (dense
  projections as target_modules, the routed experts' gate_up_proj / down_proj as target_parameters, the expert rank
  as rank_pattern). PEFT keeps the adapters in fp32 (autocast_adapter_dtype); each loaded tensor is checked equal to
  ours and to be all PEFT trains, and every one to get a gradient (AC `full`: gradient checkpointing per decoder
  layer, non-reentrant). torch's AdamW on the adapters with our settings and schedule, clipping as above.
Our run records a digest of the adapters it starts from (its model as the trainer built it) and the report says
whether they are PEFT's. At these few steps the losses cannot tell adapters apart (B starts at zero, and one Adam step
of B moves the loss little), so that digest is the check of the common start.

Prints per contender tokens/s (median over the steps after `--warmup`), MFU by our formula
(models/qwen35_moe/flops.py training_flops_per_token, attention credited by the rows' documents as hf_baseline.py does;
in LoRA mode both contenders credited the adapter parameters a token touches as our trainer counts them),
peak memory and losses; the ratios of ours to the others; each step's loss and the largest difference from ours.
A contender that fails (import, compile, out of memory) is reported with its log's last lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib
import inspect
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FULL = ("ours", "torchtitan", "transformers")  # full fine-tuning, the default
LORA = ("ours", "peft")  # with --lora RANK
FLOAT8 = ("ours", "torchtitan")  # with --float8
OUR_FLOAT8 = ["--quantize.linear_float8_recipe", "rowwise", "--quantize.grouped_mm_float8_fqns", "experts"]
# torchtitan's names of the modules our default quantize.linear_float8_filter_fqns keeps in bf16, and its router
TORCHTITAN_FLOAT8_FILTER = ["lm_head", "router.gate", "shared_experts.gate", "in_proj_a", "in_proj_b"]
CONTENDERS = (*FULL, "peft")
LABELS = {"ours": "ours", "torchtitan": "torchtitan 0.3.0", "transformers": "transformers loop",
          "peft": "transformers+PEFT"}
IGNORE_INDEX = -100
TORCHTITAN_ONLY = ("torchtitan_compile", "torchtitan_recompile_limit")  # settings no other contender reads
NO_DECAY = r"(norm\.weight|A_log|dt_bias)$"  # torchtitan's 1-D parameters: no weight decay, as ours


# ---- the parent: the shared inputs, one process per contender, the report ----

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--flavor", default="35B-A3B", help="layer widths (debugmodel: a quick check on CPU)")
    parser.add_argument("--batch", type=int, default=2, help="rows per step (training.local_batch_size)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per row (default: our config's seq_len)")
    parser.add_argument("--ac", choices=("none", "full"), default="none", help="activation checkpointing")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile (default: on a GPU only)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from the figures")
    parser.add_argument("--only", default=None, help=f"contenders to run, comma-separated (default: {','.join(FULL)}; "
                                                     f"with --lora: {','.join(LORA)})")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="LoRA at this rank (lora.rank): ours with lora.enable against transformers + PEFT "
                             "(0: full fine-tuning)")
    parser.add_argument("--lora-expert-rank", type=int, default=0, metavar="RANK",
                        help="the routed experts' own rank (lora.expert_rank; 0: --lora's)")
    parser.add_argument("--lora-alpha", type=float, default=None, help="lora.alpha (default: twice --lora)")
    parser.add_argument("--float8", action="store_true",
                        help="FP8 training (rowwise) in ours and torchtitan; the transformers loop has none")
    parser.add_argument("--torchtitan-site", default="/tmp/site_tt", help="folder holding torchtitan's packages")
    parser.add_argument("--torchtitan-compile", choices=("graph-breaks", "as-is"), default="graph-breaks",
                        help="as-is: parallelize_qwen3_5 as it is (blocks checkpointed, then compiled with "
                             "fullgraph=True, which FLA 0.5.2's compile-disabled kernel refuses); graph-breaks: "
                             "blocks compiled with fullgraph=False, then checkpointed (parallelize_one_gpu)")
    parser.add_argument("--torchtitan-recompile-limit", type=int, default=None,
                        help="torch._dynamo.config.recompile_limit for torchtitan (default: torch's, 8): its "
                             "compiled frames recompile per document count and past the limit run uncompiled")
    parser.add_argument("--work", default=None, help="folder for the shared inputs and the runs (default: a new one)")
    parser.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)  # one contender, in its own process
    parser.add_argument("overrides", nargs="*", help="our trainer's overrides, after --; the shapes, AC, compile and "
                                                     "optimizer settings they set apply to all three")
    ns = parser.parse_args(argv)
    if ns.lora < 0 or ns.lora_expert_rank < 0:
        parser.error(f"--lora ({ns.lora}) and --lora-expert-rank ({ns.lora_expert_rank}) take a rank, or 0")
    if ns.lora and ns.float8:
        parser.error("--lora and --float8 together: FP8 training is for full training (ours refuses LoRA with it)")
    if ns.lora_alpha is None:
        ns.lora_alpha = 2.0 * ns.lora
    if ns.lora:
        mode, named = LORA, "--lora"
    elif ns.float8:
        mode, named = FLOAT8, "--float8"
    else:
        mode, named = FULL, "neither --lora nor --float8"
    ns.only = [name.strip() for name in (ns.only or ",".join(mode)).split(",") if name.strip()]
    if not ns.only or set(ns.only) - set(mode):
        parser.error(f"--only takes some of {', '.join(mode)} with {named}; got {ns.only}")
    if ns.steps <= ns.warmup:
        parser.error(f"--steps ({ns.steps}) must exceed --warmup ({ns.warmup}): no step would be timed")
    return ns


def our_argv(ns: argparse.Namespace, work: Path, compile_: bool, device: str) -> list[str]:
    """Our trainer's flags: the benchmark model from the shared HF folder, the run's shapes, AC, compile and FP8."""
    from bench_model import trainer_argv

    return [*trainer_argv(work / "config.json", work / "out", ns.steps), "--checkpoint.enable", "false",
            "--checkpoint.export_hf_at_end", "false", "--training.dataset_cache_dir", str(work / "cache"),
            "--checkpoint.initial_load_hf", str(work / "hf"), "--training.local_batch_size", str(ns.batch),
            *(["--training.seq_len", str(ns.seq)] if ns.seq else []), "--activation_checkpoint.mode", ns.ac,
            "--compile.enable", str(compile_).lower(), *lora_flags(ns), *float8_flags(ns, device), *ns.overrides]


def lora_flags(ns: argparse.Namespace) -> list[str]:
    """Our trainer's LoRA flags for --lora (none without it): our default targets, the MTP layers frozen."""
    if not ns.lora:
        return []
    return ["--lora.enable", "true", "--lora.rank", str(ns.lora), "--lora.expert_rank", str(ns.lora_expert_rank),
            "--lora.alpha", f"{ns.lora_alpha:g}"]


def float8_flags(ns: argparse.Namespace, device: str) -> list[str]:
    """Our trainer's FP8 flags for --float8 (none without it), emulated on a CPU."""
    if not ns.float8:
        return []
    return [*OUR_FLOAT8, *(["--quantize.float8_emulate", "true"] if device == "cpu" else [])]


def the_rows(cfg, steps: int) -> list[dict[str, torch.Tensor]]:
    """The first `steps` batches of our data pipeline, its loader built as our trainer builds it on one device."""
    from harness.data.loader import build_dataloader
    from harness.data.tokenizer import build_tokenizer

    t = cfg.training
    loader = build_dataloader(t.dataset_source, t.dataset_path, t.dataset_text_field,
                              build_tokenizer(cfg.model.tokenizer_path), t.seq_len, t.local_batch_size, dp_rank=0,
                              dp_world_size=1, cache_dir=t.dataset_cache_dir, cache_verify=t.dataset_cache_verify)
    return [batch for _, batch in zip(range(steps), loader)]


def write_initial_weights(args, seed: int, folder: Path) -> None:
    """Our model's initial weights, drawn from the seed as our trainer draws them, as an HF folder (bf16; A_log,
    dt_bias and the GDN norm in fp32) that transformers' Qwen3_5MoeForCausalLM loads."""
    from models.qwen35_moe import Qwen35MoeModel, save_hf_checkpoint

    with torch.device("meta"):
        model = Qwen35MoeModel(args)
    model.to_empty(device="cpu")  # on the host: the GPU is left to the contenders
    model.init_weights(seed)
    save_hf_checkpoint(model.state_dict(), args, folder, dtype=torch.bfloat16)


def shared_inputs(args, cfg, steps: int, work: Path) -> list[dict[str, torch.Tensor]]:
    """The rows and the HF folder of initial weights that every contender starts from, made once per work folder: a
    later invocation on it with the same model, seed and rows reuses them (one contender per invocation fits a
    device's time limit better)."""
    t = cfg.training
    key = json.loads(json.dumps({"model": args.to_hf_config(), "seed": t.seed, "steps": steps, "seq": t.seq_len,
                                 "batch": t.local_batch_size, "data": t.dataset_path}))
    made = work / "inputs.json"
    if made.is_file() and json.loads(made.read_text()) == key:
        print(f"reusing the rows and initial weights made in {work}", flush=True)
        return torch.load(work / "batches.pt")
    made.unlink(missing_ok=True)
    batches = the_rows(cfg, steps)
    torch.save(batches, work / "batches.pt")
    print(f"writing the initial weights to {work / 'hf'} ...", flush=True)
    started = time.perf_counter()
    write_initial_weights(args, t.seed, work / "hf")
    print(f"  written in {time.perf_counter() - started:.0f} s", flush=True)
    made.write_text(json.dumps(key))
    return batches


def earlier_result(work: Path, name: str, spec: dict) -> dict | None:
    """A contender's result from an earlier invocation on this work folder with the same settings, if any (the
    settings of torchtitan's alone count for it alone)."""
    path = work / f"{name}.json"
    result = json.loads(path.read_text()) if path.is_file() else None

    def its(settings: dict) -> dict:
        return {k: v for k, v in settings.items() if name == "torchtitan" or k not in TORCHTITAN_ONLY}

    if result is None or its(result.get("spec", {})) != its(json.loads(json.dumps(spec))):  # as the child stored it
        return None
    return {**result, "notes": ["measured by an earlier invocation on this folder", *result.get("notes", [])]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(name: str, work: Path, torchtitan_site: str) -> dict:
    """Runs one contender in a process of its own; its result, or the last lines of its log."""
    env = dict(os.environ)
    if name == "torchtitan":  # its packages first (FLA 0.5.2 over ours); a one-rank process group for its FSDP
        env["PYTHONPATH"] = os.pathsep.join(p for p in (torchtitan_site, str(REPO), env.get("PYTHONPATH")) if p)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        for fla_cache in ("FLA_CACHE_MODE", "FLA_CONFIG_DIR"):  # configs tuned for FLA 0.6: 0.5.2 tunes its own
            env.pop(fla_cache, None)
    (work / f"{name}.json").unlink(missing_ok=True)
    log = work / f"{name}.log"
    print(f"running {LABELS[name]} (log: {log}) ...", flush=True)
    started = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, __file__, "--child", name, "--work", str(work)], env=env,
                              stdout=out, stderr=subprocess.STDOUT).returncode
    print(f"  {LABELS[name]}: exit {code} after {time.perf_counter() - started:.0f} s", flush=True)
    result = work / f"{name}.json"
    lines = log.read_text(errors="replace").splitlines()
    if code == 0 and result.is_file():
        measured = json.loads(result.read_text())
        measured["notes"] = [*measured.get("notes", []), *recompile_notes(lines)]
        return measured
    tail = lines[-25:]
    raised = [line for line in lines if re.search(r"\w(Error|Exception|Unsupported): ", line)]
    if raised and raised[-1] not in tail:  # the exception itself, above a long message
        tail = [raised[-1], "...", *tail]
    return {"error": tail, "exit": code}


def recompile_notes(log: list[str]) -> list[str]:
    """Where a contender's log says dynamo gave up compiling a frame: past torch's recompile_limit the frame runs
    uncompiled for the rest of the run, which its figures then include."""
    frames = sum(bool(re.search(r"\[\d+/\d+\] torch._dynamo hit config.recompile_limit", line)) for line in log)
    reasons = [line.split("last reason:", 1)[1].strip() for line in log if "last reason:" in line]
    return [f"dynamo hit its recompile_limit on {frames} compiled frame(s), which then ran uncompiled; last "
            f"reason: {reasons[-1] if reasons else 'not logged'}"] if frames else []


def timed_steps_note(rates: list[float], graphs: list[int], warmup: int) -> str:
    """The timed steps' spread and the dynamo graphs compiled inside them: `rates` the timed steps' tokens/s (steps
    warmup + 1 ...), `graphs` the graphs compiled during each step of the run (step 1 first). A frame guarded on the
    document count compiles again inside the step that first brings a new count."""
    slowest = min(range(len(rates)), key=rates.__getitem__)
    line = (f"timed steps: median {statistics.median(rates):,.0f} tok/s, slowest {rates[slowest]:,.0f} "
            f"(step {warmup + 1 + slowest}); ")
    timed = [(step, n) for step, n in enumerate(graphs, 1) if step > warmup and n]
    if not timed:
        return line + "no dynamo graph compiled in them"
    return line + (f"dynamo compiled {sum(n for _, n in timed)} graph(s) in {len(timed)} of them (step: graphs "
                   + ", ".join(f"{step}: {n}" for step, n in timed) + ")")


def report(ns, spec: dict, results: dict[str, dict], flops: float, device: str) -> list[str]:
    """The lines the script prints."""
    lines = [f"{ns.flavor} widths, {ns.layers} layers, {ns.experts} experts, seq {spec['seq']}, {spec['batch']} rows "
             f"per step, AC {spec['ac']}, compile {'on' if spec['compile'] else 'off'}, {spec['steps']} steps (first "
             f"{spec['warmup']} not timed), {device}"]
    if device == "cpu":
        lines.append("CPU: a check of the script, not a benchmark; torchtitan's FLA and FlexAttention kernels (GPU "
                     "only) replaced by plain PyTorch references (token-by-token gated delta rule, causal conv, SDPA)")
    lines.append(f"same initial weights ({spec['folder']}), same rows ({spec['steps']} batches of our pipeline, mean "
                 f"attended keys per token {spec['attended']:.0f})")
    if spec.get("float8"):
        lines.append("FP8 training, rowwise dynamic scales (torchao's recipe): the blocks' large projections and the "
                     "routed experts' grouped GEMMs; lm_head, router, shared-expert gate, in_proj_a/b in bf16; MFU "
                     "counts the same FLOPs as bf16 (against the bf16 peak)")
    lora = spec.get("lora")
    if lora:
        lines.append(f"LoRA rank {lora['rank']} (routed experts {lora['expert_rank'] or lora['rank']}), alpha "
                     f"{lora['alpha']:g} on {' '.join(lora['targets'])}; MFU credits the {spec['adapter_flops_params']:,} "
                     f"adapter parameters a token touches 6 FLOPs each, the frozen weights 4")
    ran = {name: r for name, r in results.items() if "error" not in r}
    for name, r in results.items():
        if "error" in r:
            lines.append(f"  {LABELS[name]:18s} failed (exit {r['exit']}); its log's last lines:")
            lines += [f"    | {line}" for line in r["error"]]
            continue
        mfu = f"{r['tokens_per_sec'] * flops / r['peak_flops']:.1%}" if r.get("peak_flops") else "n/a"
        losses = r["losses"]
        lines.append(f"  {LABELS[name]:18s} {r['tokens_per_sec']:>10,.0f} tok/s  MFU {mfu:>6s}  peak "
                     f"{r['max_memory_gib']:.1f} GiB  loss step 1 {losses[0]:.4f}, step {len(losses)} {losses[-1]:.4f}")
    others = [name for name in ran if name != "ours"]
    if "ours" in ran and others:
        lines.append("  ratio " + ", ".join(
            f"ours / {LABELS[n]}: {ran['ours']['tokens_per_sec'] / ran[n]['tokens_per_sec']:.2f}x" for n in others))
    if ran:
        lines.append("  loss per step:  step " + " ".join(f"{LABELS[n]:>18s}" for n in ran))
        for step in range(max(len(r["losses"]) for r in ran.values())):
            row = [f"{r['losses'][step]:18.5f}" if step < len(r["losses"]) else f"{'-':>18s}" for r in ran.values()]
            lines.append(f"                  {step + 1:4d} " + " ".join(row))
    if "ours" in ran:
        for name in others:
            diffs = [abs(a - b) for a, b in zip(ran[name]["losses"], ran["ours"]["losses"])]
            lines.append(f"  {LABELS[name]} vs ours: max |loss difference| {max(diffs):.5f} over {len(diffs)} steps, "
                         f"{diffs[0]:.5f} at step 1 (same weights, same rows, before any update)")
    if "ours" in ran and "peft" in ran:
        lines.append("  " + same_initial_adapters(ran["ours"].get("adapters_sha256"), ran["peft"].get("adapters_sha256")))
    for name, r in ran.items():
        lines += [f"  {LABELS[name]}: {note}" for note in r.get("notes", [])]
    return lines


def adapter_flops_params(args, lora) -> int:
    """The adapter parameters one token touches, as our trainer credits them (harness/trainer.py: LoraRun's
    adapter_flops_params on the model it converted; the benchmark model has no MTP layer): both LoRA contenders are
    credited these FLOPs."""
    from harness.lora.run import LoraRun
    from models.qwen35_moe import Qwen35MoeModel

    with torch.device("meta"):
        model = Qwen35MoeModel(args)
    run = LoraRun(lora, "", None)
    run.convert(model, None)
    return run.adapter_flops_params(model, args.num_experts_per_tok, train_mtp=False)


def same_initial_adapters(ours: str | None, peft: str | None) -> str:
    """The line comparing the digests of the adapters our trainer started from and of those PEFT loaded."""
    if ours is not None and ours == peft:
        return f"initial adapters: ours and those PEFT loaded are the same (sha256 {ours[:16]})"
    return (f"initial adapters DIFFER: ours sha256 {(ours or 'not recorded')[:16]}, PEFT's {(peft or 'not recorded')[:16]}"
            ": the two did not start from the same weights")


def main_parent(ns: argparse.Namespace) -> int:
    from bench_model import bench_args

    from harness.config import load_config
    from harness.lora.settings import lora_args_of
    from harness.metrics import mean_attended_keys
    from models.qwen35_moe.flops import training_flops_per_token

    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = bench_args(ns.layers, ns.experts, ns.flavor)
    work = Path(ns.work or tempfile.mkdtemp(prefix="qwen35_peer_"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(args.to_hf_config()))
    argv = our_argv(ns, work, ns.compile if ns.compile is not None else device == "cuda", device)
    cfg = load_config(argv)  # the run's settings, overrides after -- included, for all three
    batches = shared_inputs(args, cfg, ns.steps, work)
    t, o, s = cfg.training, cfg.optimizer, cfg.lr_scheduler
    attended = sum(mean_attended_keys(b["position_ids"]) for b in batches) / len(batches)
    lora = lora_args_of(cfg)  # --lora's settings with any [lora] override after --, for both LoRA contenders
    if (lora is None) != (not ns.lora):
        raise SystemExit("the overrides after -- turn LoRA on or off: use --lora RANK (0: off) instead")
    adapters = adapter_flops_params(args, lora) if lora is not None else None
    spec = {"model": args.to_hf_config(), "argv": argv, "folder": str(work / "hf"),
            "batches": str(work / "batches.pt"), "steps": ns.steps,
            "warmup": ns.warmup, "seq": t.seq_len, "batch": t.local_batch_size, "ac": cfg.activation_checkpoint.mode,
            "compile": cfg.compile.enable, "attended": attended, "max_norm": t.max_norm, "gc_freq": t.gc_freq,
            "adamw": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay},
            "schedule": {"warmup_steps": s.warmup_steps, "decay_ratio": s.decay_ratio, "decay_type": s.decay_type,
                         "min_lr_factor": s.min_lr_factor},
            "torchtitan_compile": ns.torchtitan_compile, "torchtitan_recompile_limit": ns.torchtitan_recompile_limit,
            "seed": t.seed, "float8": ns.float8, "lora": None if lora is None else dataclasses.asdict(lora),
            "adapter_flops_params": adapters}
    (work / "spec.json").write_text(json.dumps(spec, indent=1))
    results = {}
    for name in LORA if lora is not None else FLOAT8 if ns.float8 else FULL:
        result = launch(name, work, ns.torchtitan_site) if name in ns.only else earlier_result(work, name, spec)
        if result is not None:
            results[name] = result
    flops = training_flops_per_token(args, attended, adapter_params=adapters)
    print("\n".join(report(ns, spec, results, flops, device)))
    return 0


# ---- each contender, in a process of its own ----

def lr_multiplier(spec: dict):
    """Our lr schedule (harness/optim/lr_schedule.py) as a LambdaLR multiplier: its counter n is update n + 1."""
    from harness.optim.lr_schedule import lr_factor

    s = spec["schedule"]
    return lambda n: lr_factor(n + 1, spec["steps"], s["warmup_steps"], s["decay_ratio"], s["decay_type"],
                               s["min_lr_factor"])


def the_device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


class CheckedLoader:
    """Our trainer's loader, each batch it draws checked equal to the saved rows the others train on."""

    def __init__(self, loader, expected: list[dict[str, torch.Tensor]]):
        self.loader, self.expected, self.checked = loader, expected, 0

    def __iter__(self):
        for batch in self.loader:
            if self.checked < len(self.expected):
                want = self.expected[self.checked]
                if batch.keys() != want.keys() or not all(torch.equal(batch[k], want[k]) for k in want):
                    raise SystemExit(f"our trainer's batch {self.checked + 1} differs from the saved rows")
                self.checked += 1
            yield batch

    def __getattr__(self, name):
        return getattr(self.loader, name)


def run_ours(spec: dict, work: Path) -> dict:
    from bench_model import run_figures, step_losses

    import harness.data_setup
    import harness.trainer
    from harness.config import load_config
    from harness.metrics import peak_flops
    from harness.train import main as train_main
    from models.qwen35_moe import Qwen35MoeArgs

    expected, loaders, build = torch.load(spec["batches"]), [], harness.data_setup.build_dataloader
    digests, build_model = [], harness.trainer.build_model

    def checked_loader(*args, **kwargs):
        loaders.append(CheckedLoader(build(*args, **kwargs), expected))
        return loaders[-1]

    def recorded_model(*args, **kwargs):  # the adapters the run starts from, for the report to compare with PEFT's
        model = build_model(*args, **kwargs)
        digests.append(adapters_sha256(adapter_tensors(model)))
        return model

    harness.data_setup.build_dataloader = checked_loader  # what the trainer's loaders are built by
    harness.trainer.build_model = recorded_model  # what the trainer's model is built by
    if train_main(spec["argv"]) != 0:
        raise SystemExit("our trainer failed")
    cfg = load_config(spec["argv"])
    metrics = Path(cfg.job.dump_folder) / "metrics.jsonl"
    figures, losses = run_figures(metrics, spec["warmup"]), step_losses(metrics)
    balance = cfg.training.aux_loss_coef
    if balance < 0:  # the model's own
        balance = Qwen35MoeArgs.from_hf_config(spec["folder"]).router_aux_loss_coef
    notes = [f"read the corpus itself; its {loaders[0].checked} batches equal the saved rows",
             f"trains with the MoE balance loss (weight {balance:g}) too; its losses above are the cross entropy"]
    if spec.get("float8"):
        notes.append(f"FP8: {' '.join(OUR_FLOAT8)}" + (" --quantize.float8_emulate true (GEMMs emulated in high "
                                                         "precision)" if the_device().type == "cpu" else ""))
    if spec.get("lora"):
        cuda = the_device().type == "cuda"
        notes.append(f"lora.enable: {cfg.training.mixed_precision_param if cuda else 'fp32'} frozen base (no gradient "
                     f"or optimizer state), fp32 adapters and AdamW states{', bf16 compute' if cuda else ''}, the "
                     f"routed experts' adapters {'as grouped GEMMs' if cuda else 'expert by expert'} beside the "
                     f"base's; compile {'on' if spec['compile'] else 'off'}")
    return {"tokens_per_sec": figures["tokens_per_sec"], "max_memory_gib": figures["max_memory_gib"],
            "losses": [losses[step] for step in sorted(losses)], "peak_flops": peak_flops(the_device()),
            "adapters_sha256": digests[0] if spec.get("lora") else None, "notes": notes}


def hf_optimizer(params: list[torch.nn.Parameter], spec: dict) -> torch.optim.AdamW:
    """torch's AdamW over the trained parameters with our settings: weight decay on matrices only, as ours."""
    a = spec["adamw"]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": a["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=a["lr"], betas=tuple(a["betas"]), eps=a["eps"])


def hf_loss(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A transformers model's loss on plain rows with our labels (next tokens, none across a document boundary), as
    the others'."""
    import torch.nn.functional as F

    logits = model(input_ids=batch["input_ids"]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)


def hf_train(model, spec: dict) -> dict:
    """hf_baseline.py's loop over the saved rows: the trained parameters, our optimizer settings, our schedule, our
    clipping."""
    from hf_baseline import train_loop

    optimizer = hf_optimizer([p for p in model.parameters() if p.requires_grad], spec)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(spec))
    return train_loop(model, optimizer, torch.load(spec["batches"]), the_device(), spec["warmup"], hf_loss,
                      max_norm=spec["max_norm"], scheduler=scheduler)


def run_transformers(spec: dict, work: Path) -> dict:
    from hf_baseline import transformers_model

    from harness.metrics import peak_flops
    from models.qwen35_moe import Qwen35MoeArgs

    device, folder = the_device(), Path(spec["folder"])
    model = transformers_model(Qwen35MoeArgs.from_hf_config(folder), device, folder)
    if spec["ac"] != "none":  # transformers' own: each decoder layer recomputed in the backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    result = hf_train(model, spec)
    return {**result, "peak_flops": peak_flops(device),
            "notes": [f"plain rows: attends across documents and carries the GDN state over them (no position ids "
                      f"or document masks); {'bf16' if device.type == 'cuda' else 'fp32'} weights and AdamW states "
                      f"(torch's default AdamW); not compiled; AC "
                      f"{'per decoder layer' if spec['ac'] != 'none' else 'none'}"]}


def lora_args(spec: dict):
    from models.qwen35_moe.lora_targets import LoraArgs

    return LoraArgs(**{**spec["lora"], "targets": tuple(spec["lora"]["targets"])})


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our model's adapters by their native keys (models/qwen35_moe/lora_targets.py), fp32 on the host."""
    from torch.distributed.tensor import DTensor

    from models.qwen35_moe.hooks import canonical_name  # less the wrappers AC and compile put in a name
    from models.qwen35_moe.lora_targets import is_adapter_key

    tensors = {}
    for name, param in model.named_parameters():
        if is_adapter_key(canonical_name(name)):
            whole = param.full_tensor() if isinstance(param, DTensor) else param
            tensors[canonical_name(name)] = whole.detach().to("cpu", torch.float32)
    return tensors


def adapters_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """A digest of adapters by native key: their keys, shapes and fp32 values."""
    digest = hashlib.sha256()
    for key in sorted(tensors):
        digest.update(f"{key}:{tuple(tensors[key].shape)}".encode())
        digest.update(tensors[key].contiguous().numpy().tobytes())
    return digest.hexdigest()


def our_initial_adapters(args, lora, seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Our LoRA model's initial adapters, drawn as our trainer draws them (harness/model_setup.py build_model: built
    on meta, converted by the run's LoRA part, materialised on the device, then init_weights(seed)). Each is drawn
    from (seed, its name) on the device: the same on one device type at any sharding, but CPU and CUDA generators
    draw different numbers (models/qwen35_moe/init.py), so they are drawn on the device the contenders train on."""
    from harness.lora.run import LoraRun
    from models.qwen35_moe import Qwen35MoeModel

    with torch.device("meta"):
        model = Qwen35MoeModel(args)
    LoraRun(lora, "", seed).convert(model, torch.bfloat16 if device.type == "cuda" else None)  # the base held as ours
    model.to_empty(device=device)
    model.init_weights(seed)
    tensors = adapter_tensors(model)
    del model
    if device.type == "cuda":  # the base drawn alongside, gone before the contender's own model and memory peak
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return tensors


def check_loaded_adapters(model, ours: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Checks that PEFT's model trains exactly our adapters, each equal to ours as PEFT holds it (harness/lora/peft.py
    `to_peft`), the MTP layers' aside (transformers has none); returns how many tensors and parameters."""
    from peft import get_peft_model_state_dict

    from harness.lora.peft import peft_layout, to_peft

    layout = peft_layout({key: tuple(value.shape) for key, value in ours.items()})
    loaded = get_peft_model_state_dict(model)  # PEFT's saved names, as the folder holds them
    if loaded.keys() != layout.native_of.keys():
        differ = sorted(loaded.keys() ^ layout.native_of.keys())
        raise SystemExit(f"PEFT adapted other modules than ours: {', '.join(differ[:4])} ({len(differ)} in all)")
    for key, native in layout.native_of.items():
        if not torch.equal(loaded[key].detach().to("cpu", torch.float32), to_peft(native, ours[native])):
            raise SystemExit(f"PEFT's {key} is not our {native} as the PEFT folder holds it")
    trained = [p for p in model.parameters() if p.requires_grad]
    if sum(p.numel() for p in trained) != sum(ours[native].numel() for native in layout.native_of.values()):
        raise SystemExit(f"PEFT trains {sum(p.numel() for p in trained):,} parameters, not just our adapters'")
    return len(layout.native_of), sum(p.numel() for p in trained)


def run_peft(spec: dict, work: Path) -> dict:
    import peft
    from hf_baseline import transformers_model
    from peft import PeftModel

    from harness.lora.peft import write_peft_adapter
    from harness.metrics import peak_flops
    from models.qwen35_moe import Qwen35MoeArgs

    device, folder, lora = the_device(), Path(spec["folder"]), lora_args(spec)
    args = Qwen35MoeArgs.from_hf_config(folder)
    ours = our_initial_adapters(args, lora, spec["seed"], device)
    adapters = work / "peft-adapter"
    write_peft_adapter(adapters, lora, {key: tuple(value.shape) for key, value in ours.items()}, ours.__getitem__,
                       base=str(folder))
    model = transformers_model(args, device, folder)  # the transformers contender's; bf16 on a GPU, fp32 on CPU
    if spec["ac"] != "none":  # transformers' own, on the base model PEFT wraps: each decoder layer recomputed
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = PeftModel.from_pretrained(model, adapters, is_trainable=True)  # adapters in fp32 (autocast_adapter_dtype)
    tensors, params = check_loaded_adapters(model, ours)
    trained = [p for p in model.parameters() if p.requires_grad]
    reached = set()
    for p in trained:  # with AC too: the gradients must reach every adapter through the recomputed layers
        p.register_post_accumulate_grad_hook(lambda p: reached.add(id(p)))
    result = hf_train(model, spec)
    if len(reached) != len(trained):
        raise SystemExit(f"no gradient reached {len(trained) - len(reached)} of PEFT's {len(trained)} adapter tensors")
    base = {"cuda": "bf16"}.get(device.type, "fp32")
    dtypes = "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in trained}))
    return {**result, "peak_flops": peak_flops(device), "adapters_sha256": adapters_sha256(ours),
            "notes": [f"the transformers loop's model and rows (attends across documents), its {base} base frozen, "
                      f"with peft {peft.__version__}'s PeftModel.from_pretrained(is_trainable=True) on a PEFT folder "
                      f"of our initial adapters ({adapters}, written by harness/lora/peft.py from our model with "
                      f"LoRA drawn from seed {spec['seed']} on {device.type} as our trainer draws it)",
                      f"PEFT trains exactly our adapters: {tensors} tensors, {params:,} parameters, each equal to "
                      f"ours as loaded; gradients reached all of them",
                      f"adapters and AdamW states {dtypes} (PEFT's autocast_adapter_dtype), dense adapters computed "
                      f"in {dtypes} (PEFT casts their input), the routed experts' through PEFT's ParamWrapper "
                      f"(W + s B A formed in the {base} base's dtype at every forward); torch's default AdamW; not "
                      f"compiled; AC {'per decoder layer' if spec['ac'] != 'none' else 'none'}"]}


# What torchtitan 0.3.0 (which follows torch's nightly builds) uses and torch 2.11 lacks, found on torch 2.11 by
# importing torchtitan's Qwen3.5 model, state-dict adapter, parallelize, compile, activation checkpointing, loss and
# optimizer modules, and by running this script's CPU check, which takes the one-GPU path but for the kernels it
# replaces. Each stand-in is set only where torch lacks the original.
class _DataParallelMeshDims:
    """torch.distributed.fsdp.DataParallelMeshDims (torch >= 2.12), imported at module level by torchtitan's fsdp.py
    and full_dtensor.py, for annotations and for fully_shard(dp_mesh_dims=...) of its spmd_types and full_dtensor
    backends over more than one rank. Not used on the one-GPU path: this stand-in refuses to be made."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("torch.distributed.fsdp.DataParallelMeshDims needs torch >= 2.12")


def _with_full_blocks(create_block_mask):
    """create_block_mask taking torch 2.12's `separate_full_blocks`. Used on the one-GPU path, every step: torchtitan
    builds its document mask with separate_full_blocks=True, which torch 2.11 always does
    (_convert_mask_to_block_mask(..., separate_full_blocks=True)); the stand-in drops the keyword, and refuses
    False (torchtitan's batch-invariant mode, not used here)."""

    def with_full_blocks(*args, separate_full_blocks: bool = True, **kwargs):
        if not separate_full_blocks:
            raise NotImplementedError("create_block_mask(separate_full_blocks=False) needs torch >= 2.12")
        return create_block_mask(*args, **kwargs)

    return with_full_blocks


def _uniform_reduce_dtype(foreach_reduce):
    """FSDP2's foreach_reduce taking one group's gradients in two dtypes, cast to the wider (the reduce dtype, fp32)
    first, as foreach_reduce casts them itself when it copies them into its reduce dtype buffer: the same values
    reduced. Needed on torch whose FSDP2 lacks the chunked-loss fix (FSDPState._force_complete_incomplete_states,
    torch >= 2.13), used on the one-GPU path at every step: torchtitan's ChunkedLossWrapper runs lm_head alone,
    chunk by chunk, with gradient sync off but for the last chunk, while FSDP2 shards it in one group with the final
    norm (fully_shard([norm, lm_head])). Without the fix the group's post-forward first completes in the first
    chunk, whose backward then runs FSDP2's end-of-backward callback; the later chunks' post-backward hooks do not
    reduce, so lm_head's gradient, accumulated in fp32 (the reduce dtype) by the chunks without sync, is reduced only
    in the decoder's backward, together with the norm's bf16 gradient, and foreach_reduce refuses the mix
    ("FSDP reduce-scatter expects uniform gradient dtype but got {torch.bfloat16, torch.float32}"). On torch 2.11
    the chunks after the first two add their lm_head gradients in bf16 (autograd accumulating into the bf16
    parameter's .grad), where torch >= 2.13 moves each into fp32."""

    def with_uniform_dtype(fsdp_params, unsharded_grads, *args, **kwargs):
        dtypes = {grad.dtype for grad in unsharded_grads}
        if len(dtypes) > 1:
            wider = functools.reduce(torch.promote_types, dtypes)
            unsharded_grads[:] = [grad.to(wider) for grad in unsharded_grads]  # the list owns them, as FSDP's
        return foreach_reduce(fsdp_params, unsharded_grads, *args, **kwargs)

    return with_uniform_dtype


def add_torch_stand_ins() -> list[str]:
    """Sets the stand-ins this torch needs; before torchtitan is imported. Returns what it set."""
    import torch.distributed.fsdp as fsdp
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_param_group
    import torch.nn.attention.flex_attention as flex
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    added = []
    if not hasattr(fsdp, "DataParallelMeshDims"):
        fsdp.DataParallelMeshDims = _DataParallelMeshDims
        added.append("torch.distributed.fsdp.DataParallelMeshDims")
    if "separate_full_blocks" not in inspect.signature(flex.create_block_mask).parameters:
        flex.create_block_mask = _with_full_blocks(flex.create_block_mask)
        added.append("create_block_mask(separate_full_blocks=)")
    if not hasattr(FSDPState, "_force_complete_incomplete_states"):
        fsdp_param_group.foreach_reduce = _uniform_reduce_dtype(fsdp_param_group.foreach_reduce)
        added.append("FSDP2 reducing lm_head's fp32 and the final norm's bf16 gradients together (chunked loss)")
    return added


def run_on_cpu() -> None:
    """CPU only, a check of the script; before torchtitan's other modules are imported. torchtitan takes its device
    type to be CUDA when it finds no accelerator (its modules read it at import): here it is the CPU. Its model's
    kernels that need a GPU are replaced: FLA's chunked gated delta rule (compile-disabled, as FLA's) and varlen
    causal conv by our plain PyTorch references, FlexAttention (no backward on CPU) by SDPA with the dense form of
    its block mask."""
    import torch.nn.functional as F
    import torchtitan.tools.utils as tt_tools
    from torch.nn.attention.flex_attention import create_mask

    from models.qwen35_moe.kernels.causal_conv import torch_causal_conv1d
    from models.qwen35_moe.kernels.gated_delta_rule import naive_recurrent_gated_delta_rule

    tt_tools.device_type, tt_tools.device_module = "cpu", torch.cpu
    import torchtitan.models.qwen3_5.model as tt_model
    from torchtitan.models.common.attention import FlexAttention

    @torch.compiler.disable
    def chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **_):
        assert use_qk_l2norm_in_kernel  # the reference normalises q and k, as torchtitan asks FLA to
        return naive_recurrent_gated_delta_rule(q, k, v, g, beta, cu_seqlens), None

    def causal_conv1d(x, weight, bias=None, activation=None, cu_seqlens=None, **_):
        assert bias is None and activation == "silu"  # the reference applies SiLU
        return torch_causal_conv1d(x, weight, cu_seqlens), None

    def flex_attention(q, k, v, *, block_mask, scale, enable_gqa, **_):
        mask = create_mask(block_mask.mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa), None

    tt_model._fla_chunk_gated_delta_rule = chunk_gated_delta_rule  # torchtitan's module holds FLA's function
    # torchtitan imports this one from FLA's module at each call (the package's `causal_conv1d` is the function)
    importlib.import_module("fla.modules.conv.causal_conv1d").causal_conv1d = causal_conv1d
    FlexAttention._compiled_flex_attn = flex_attention


def check_fla_hopper_backward(args, device: torch.device) -> None:
    """FLA 0.5.2 refuses its gated delta rule backward on Hopper with Triton < 3.7.1, as 0.6.0 does: the self-check
    our trainer and the transformers loop pass before bypassing that guard, on FLA 0.5.2's kernel as torchtitan calls
    it (q and k repeated for the value heads, normalised in the kernel)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from models.qwen35_moe.kernels.fla_hopper_guard import enable_fla_hopper_backward

    def kernel(q, k, v, g, beta, cu_seqlens=None):
        r = v.shape[2] // q.shape[2]
        return chunk_gated_delta_rule(q.repeat_interleave(r, 2), k.repeat_interleave(r, 2), v, g, beta,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens,
                                      cu_seqlens_cpu=cu_seqlens.cpu())[0]

    enable_fla_hopper_backward(args.linear_num_key_heads, args.linear_num_value_heads, args.linear_key_head_dim,
                               args.linear_value_head_dim, device, kernel=kernel)


def torchtitan_config(args, seq_len: int):
    """torchtitan's Qwen3.5 model config at `args`' widths from its own 35B-A3B builders, with FlexAttention (its
    model registry's default; its varlen backend passes torch 2.12's varlen_attn arguments). Without its
    auxiliary-loss-free expert bias, which Qwen3.5 does not have and its HF export drops: the same model as ours."""
    import torchtitan.models.qwen3_5 as tt
    from torchtitan.models.common import Embedding, Linear

    fixed = {"layer_types": [("full_attention" if (i + 1) % args.full_attention_interval == 0 else "linear_attention")
                             for i in range(args.num_hidden_layers)],
             "rms_norm_eps": 1e-6, "linear_conv_kernel_dim": 4, "tie_word_embeddings": False}
    differ = [key for key, value in fixed.items() if getattr(args, key) != value]
    if differ:  # torchtitan's builders fix these
        raise SystemExit(f"torchtitan's Qwen3.5 builders cannot take these model settings: {differ}")
    rope = tt.MRoPE.Config(dim=args.rotary_dim, max_seq_len=seq_len, theta=args.rope_theta,
                           mrope_section=list(args.mrope_section))
    layers = tt._build_qwen35_moe_layers(
        rope=rope, attn_backend="flex", n_layers=args.num_hidden_layers, dim=args.hidden_size,
        n_heads=args.num_attention_heads, n_kv_heads=args.num_key_value_heads, head_dim=args.head_dim,
        rotary_dim=args.rotary_dim, moe_hidden_dim=args.moe_intermediate_size, num_experts=args.num_experts,
        top_k=args.num_experts_per_tok, shared_expert_hidden_dim=args.shared_expert_intermediate_size,
        n_key_heads=args.linear_num_key_heads, n_value_heads=args.linear_num_value_heads,
        key_head_dim=args.linear_key_head_dim, value_head_dim=args.linear_value_head_dim,
        full_attention_interval=args.full_attention_interval, moe_comm_backend="standard")
    for layer in layers:
        layer.moe.load_balance_coeff = None
    dim, vocab = args.hidden_size, args.vocab_size
    return dataclasses.replace(
        tt.qwen3_5_configs["35B-A3B"](attn_backend="flex", moe_comm_backend="standard"),
        vocab_size=vocab, dim=dim, layers=layers, norm=tt._offset_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=tt._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=tt._output_linear_init(dim)))


def torchtitan_float8(model_config, compile_: bool):
    """torchtitan's float8 converters applied to its model config, in the order and the way its float8 model configs
    apply them (deepseek_v3's: dense linears, then the grouped experts), on the modules ours converts."""
    from torchtitan.components.quantization import Float8GroupedExpertsConverter, Float8LinearConverter

    for converter in (Float8LinearConverter.Config(recipe_name="rowwise", filter_fqns=TORCHTITAN_FLOAT8_FILTER,
                                                   model_compile_enabled=compile_),
                      Float8GroupedExpertsConverter.Config(model_compile_enabled=compile_)):
        model_config = converter.build().convert(model_config)
    return model_config


def torchtitan_input(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The folder's tensors as torchtitan 0.3.0's `from_hf` reads them. It reads the release's multimodal names
    (model.language_model.*; given transformers' text-only model.* it maps lm_head alone), and takes the experts
    transposed from transformers' layout, gate_up_proj (E, 2F, D) and down_proj (E, D, F) (fixed after 0.3.0, by
    torchtitan#4373): both are transposed here, which its from_hf undoes."""
    renamed = {}
    for key, value in hf.items():
        if key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            value = value.transpose(-2, -1)
        renamed[re.sub(r"^model\.", "model.language_model.", key)] = value
    return renamed


def hf_source(name: str, hf: dict[str, torch.Tensor], args) -> torch.Tensor:
    """The HF tensor, or the slice of one, that torchtitan's parameter `name` must equal, by transformers' layout:
    in_proj_qkv and conv1d stack q, k, v; gate_up_proj (E, 2F, D) stacks gate over up; down_proj is (E, D, F)."""
    top = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "lm_head.weight": "lm_head.weight"}
    if name in top:
        return hf[top[name]]
    layer, rest = re.fullmatch(r"layers\.(\d+)\.(.+)", name).groups()
    p = f"model.layers.{layer}."
    renamed = {"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
               "attn.wq.weight": "self_attn.q_proj.weight", "attn.wk.weight": "self_attn.k_proj.weight",
               "attn.wv.weight": "self_attn.v_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
               "attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight",
               "attn.in_proj_z.weight": "linear_attn.in_proj_z.weight",
               "attn.in_proj_a.weight": "linear_attn.in_proj_a.weight",
               "attn.in_proj_b.weight": "linear_attn.in_proj_b.weight", "attn.A_log": "linear_attn.A_log",
               "attn.dt_bias": "linear_attn.dt_bias", "attn.norm.weight": "linear_attn.norm.weight",
               "attn.out_proj.weight": "linear_attn.out_proj.weight", "moe.router.gate.weight": "mlp.gate.weight",
               "moe.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
               "moe.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
               "moe.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
               "moe.shared_experts.gate.weight": "mlp.shared_expert_gate.weight",
               "moe.routed_experts.inner_experts.w2_EDF": "mlp.experts.down_proj"}
    if rest in renamed:
        return hf[p + renamed[rest]]
    kd, f = args.linear_num_key_heads * args.linear_key_head_dim, args.moe_intermediate_size
    q, k, v = slice(0, kd), slice(kd, 2 * kd), slice(2 * kd, None)
    stacked = {"attn.in_proj_q.weight": ("linear_attn.in_proj_qkv.weight", q),
               "attn.in_proj_k.weight": ("linear_attn.in_proj_qkv.weight", k),
               "attn.in_proj_v.weight": ("linear_attn.in_proj_qkv.weight", v),
               "attn.conv_q.weight": ("linear_attn.conv1d.weight", q),
               "attn.conv_k.weight": ("linear_attn.conv1d.weight", k),
               "attn.conv_v.weight": ("linear_attn.conv1d.weight", v)}
    if rest in stacked:
        key, rows = stacked[rest]
        return hf[p + key][rows]
    gate_or_up = {"moe.routed_experts.inner_experts.w1_EFD": slice(0, f),
                  "moe.routed_experts.inner_experts.w3_EFD": slice(f, None)}[rest]
    return hf[p + "mlp.experts.gate_up_proj"][:, gate_or_up]


def load_and_check(model, args, folder: Path) -> int:
    """Loads the HF folder into torchtitan's FSDP-wrapped model through its own state-dict adapter, then checks each
    parameter equal to the HF tensor it came from; returns how many it checked."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor
    from torchtitan.models.qwen3_5 import Qwen35StateDictAdapter

    from models.qwen35_moe import load_hf_state_dict
    from models.qwen35_moe.hooks import canonical_name  # less the wrappers AC and compile put in a name

    hf = load_hf_state_dict(folder)
    state = Qwen35StateDictAdapter(model.config, None).from_hf(torchtitan_input(hf))
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))
    checked = 0
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param  # a one-rank mesh: the whole tensor
        want = hf_source(canonical_name(name), hf, args)
        if local.shape != want.shape or not torch.equal(local.detach(), want.to(local.device, local.dtype)):
            raise SystemExit(f"torchtitan's {canonical_name(name)} is not the HF tensor it should come from")
        checked += 1
    return checked


def compile_with_graph_breaks(model, compile_config, parallel_dims) -> None:
    """torchtitan's apply_compile, which compiles each block with fullgraph=True: FLA 0.5.2's chunk_gated_delta_rule
    is torch.compiler.disable'd, which fullgraph refuses. Here the blocks compile with fullgraph=False, and FLA's
    causal conv is kept out of the graphs too (not traced into FLA's Triton autotuner): FLA's kernels run between
    compiled graphs, as in our trainer."""
    from torchtitan.distributed.compile import apply_compile

    if torch.cuda.is_available():  # on CPU a reference replaces it
        conv = importlib.import_module("fla.modules.conv.causal_conv1d")
        conv.causal_conv1d = torch.compiler.disable(conv.causal_conv1d)
    compile_module = torch.nn.Module.compile

    def with_graph_breaks(self, *args, **kwargs):
        return compile_module(self, *args, **{**kwargs, "fullgraph": False})

    torch.nn.Module.compile = with_graph_breaks
    try:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    finally:
        torch.nn.Module.compile = compile_module


def parallelize_one_gpu(model, parallel_dims, training, compile_config, ac_config, dump_folder: str):
    """parallelize_qwen3_5 on one GPU (no TP, EP, CP or PP, no vision tower) by its own functions, with two changes
    that let FLA 0.5.2 run compiled: the blocks compile with graph breaks (compile_with_graph_breaks), and before
    activation checkpointing wraps them, not after: compile over a checkpointed block traces the checkpoint whole,
    which a block with graph breaks cannot be, and dynamo then runs the Gated DeltaNet blocks eagerly."""
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    if compile_config.enable:
        compile_with_graph_breaks(model, compile_config, parallel_dims)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)
    apply_fsdp_to_decoder(model, parallel_dims.get_mesh(["fsdp"]),
                          param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
                          reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce], pp_enabled=False)
    return model


def run_torchtitan(spec: dict, work: Path) -> dict:
    began = time.perf_counter()
    stand_ins = add_torch_stand_ins()
    cuda = torch.cuda.is_available()
    if not cuda:
        run_on_cpu()
    from torch._dynamo.utils import counters as dynamo_counters
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import (
        LRSchedulersContainer,
        OptimizersContainer,
        ParamGroupConfig,
        register_moe_load_balancing_hook,
    )
    from torchtitan.config import CommConfig, CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.qwen3_5 import parallelize_qwen3_5
    from torchtitan.tools.utils import GarbageCollection

    from harness.metrics import max_memory_gib, peak_flops
    from models.qwen35_moe import Qwen35MoeArgs

    device, folder = the_device(), Path(spec["folder"])
    if cuda:
        torch.cuda.set_device(device)
    if spec.get("torchtitan_recompile_limit") is not None:  # raised as its gpt_oss raises it; its qwen3_5 does not
        torch._dynamo.config.recompile_limit = spec["torchtitan_recompile_limit"]
    args = Qwen35MoeArgs.from_hf_config(folder)
    print(f"torchtitan: imports {time.perf_counter() - began:.0f} s", flush=True)
    if cuda:
        check_fla_hopper_backward(args, device)
        print(f"torchtitan: FLA's self-check done at {time.perf_counter() - began:.0f} s", flush=True)
    dist_utils.init_distributed(CommConfig(), base_folder=str(work))
    # One GPU: no TP, EP, CP or PP, so its default spmd_types backend would only annotate types. partial_dtensor takes
    # the same one-GPU path without model.update_from_config, which the annotations need and which imports
    # torchtitan's trainer, and with it its data-loading packages.
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    parallel_dims = ParallelDims.from_config(parallelism, world_size=1)
    batches = torch.load(spec["batches"])
    # Its trainer's mixed precision on a GPU; fp32 compute on CPU, as ours there.
    training = TrainingConfig(local_batch_size=spec["batch"], seq_len=spec["seq"], steps=spec["steps"],
                              mixed_precision_param="bfloat16" if cuda else "float32",
                              disable_cuda_graphs=True)  # as its MoE recipes
    compile_config = CompileConfig(enable=spec["compile"])
    model_config = torchtitan_config(args, spec["seq"])
    if spec.get("float8"):
        model_config = torchtitan_float8(model_config, spec["compile"])
    with torch.device("meta"):
        model = model_config.build()
    model.vision_encoder = None  # text only: no vision tower in memory or in the optimizer
    ac_config = {"none": None, "full": FullAC.Config(), "selective": SelectiveAC.Config()}[spec["ac"]]
    if spec["torchtitan_compile"] == "as-is":
        model = parallelize_qwen3_5(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                                    compile_config=compile_config, ac_config=ac_config, dump_folder=str(work))
    else:
        model = parallelize_one_gpu(model, parallel_dims, training, compile_config, ac_config, str(work))
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # its buffers (RoPE cache, expert counts); the weights come next
    print(f"torchtitan: model built and parallelized at {time.perf_counter() - began:.0f} s", flush=True)
    checked = load_and_check(model, args, folder)
    print(f"torchtitan: HF folder loaded and checked at {time.perf_counter() - began:.0f} s", flush=True)
    model.train()

    a = spec["adamw"]
    adamw = {"lr": a["lr"], "betas": tuple(a["betas"]), "eps": a["eps"]}
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=NO_DECAY, optimizer_name="AdamW",
                                       optimizer_kwargs={**adamw, "weight_decay": 0.0}),
                      ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                                       optimizer_kwargs={**adamw, "weight_decay": a["weight_decay"]})],
        implementation="fused" if cuda else "for-loop").build(model_parts=[model])
    undecayed = {id(p) for p in optimizers.optimizers[0].param_groups[0]["params"]}
    if undecayed != {id(p) for p in model.parameters() if p.ndim < 2}:
        raise SystemExit(f"the no-decay pattern {NO_DECAY!r} does not pick exactly the 1-D parameters")
    register_moe_load_balancing_hook(optimizers, [model], parallel_dims)  # as its trainer; none without expert bias
    schedulers = LRSchedulersContainer(optimizers, lr_multiplier(spec))
    loss_fn = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=args.vocab_size)).build(
        compile_config=compile_config)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True  # lm_head runs in the loss, chunk by chunk, as its trainer sets it up
    gc_handler = GarbageCollection(gc_freq=spec["gc_freq"])
    no_images = {"image_id": -1, "video_id": -1}  # its multimodal forward looks these up; no pixels are passed
    max_norm = math.inf if spec["max_norm"] is None else spec["max_norm"]  # None: the norm unclipped, as ours

    setup_s = time.perf_counter() - began
    print(f"torchtitan: {setup_s:.0f} s to its first step (imports, FLA's self-check, HF folder loaded and checked)",
          flush=True)
    rates, losses, graphs, first_step_s = [], [], [], None
    for step, batch in enumerate(batches, 1):
        graphs_before = dynamo_counters["stats"]["unique_graphs"]
        gc_handler.run(step)
        optimizers.zero_grad(set_to_none=True)
        inputs, labels, positions = (batch[k].to(device) for k in ("input_ids", "labels", "position_ids"))
        valid_tokens = (batch["labels"] != IGNORE_INDEX).sum().to(device)
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        masks = model.get_attention_masks(positions=positions)  # flex block mask, GDN cu_seqlens
        pred = model(inputs, attention_masks=masks, positions=positions, special_tokens=no_images)
        loss, _ = loss_fn(pred, labels, valid_tokens, positions=positions)
        del pred
        loss.backward()
        dist_utils.clip_grad_norm_(list(model.parameters()), max_norm, foreach=True)
        optimizers.step()
        schedulers.step()
        if cuda:
            torch.cuda.synchronize(device)
        if step > spec["warmup"]:
            rates.append(inputs.numel() / (time.perf_counter() - start))
        losses.append(loss.item())
        graphs.append(dynamo_counters["stats"]["unique_graphs"] - graphs_before)
        if step == 1:
            first_step_s = time.perf_counter() - start
            print(f"torchtitan: first step {first_step_s:.0f} s (compile, kernel tuning), loss {losses[0]:.4f}",
                  flush=True)

    compiled = {"as-is": "its apply_compile as parallelize_qwen3_5 calls it (after AC, fullgraph=True)",
                "graph-breaks": "its apply_compile with fullgraph=False (FLA's kernels between graphs), before AC",
                }[spec["torchtitan_compile"]] if spec["compile"] else "off"
    notes = [f"torch {torch.__version__}; dynamo's recompile_limit {torch._dynamo.config.recompile_limit}; "
             f"stand-ins for what this torch lacks: {', '.join(stand_ins) or 'none'}",
             f"FSDP2 on a one-rank mesh (resharding after forward, its default): fp32 parameters, "
             f"{'bf16 compute (every parameter cast, A_log and dt_bias too)' if cuda else 'fp32 compute'}, fp32 "
             f"gradients; AC {spec['ac']}; compile {compiled}; flex attention within documents, GDN state and conv "
             f"reset per document; chunked cross entropy; {'fused' if cuda else 'for-loop'} AdamW; no expert bias",
             f"HF folder loaded through its Qwen35StateDictAdapter.from_hf: {checked} parameters checked equal to "
             f"the HF tensors they came from",
             f"{setup_s:.0f} s from its start to its first step, which took {first_step_s:.0f} s" + (
                 " (its compile, FlexAttention with max_autotune and coordinate descent tuning as torchtitan ships "
                 "it, FLA 0.5.2's autotuning)" if cuda else ""), timed_steps_note(rates, graphs, spec["warmup"])]
    if spec.get("float8"):
        kinds = [type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Float8")]
        notes.append(f"FP8: its Float8LinearConverter (rowwise, filter_fqns {TORCHTITAN_FLOAT8_FILTER}) and "
                     f"Float8GroupedExpertsConverter; modules converted: "
                     + ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds))))
    if not cuda:  # why its losses differ from ours on CPU, in the fourth or fifth digit
        notes.append("its grouped GEMMs run the routed experts in bf16 on any device")
    return {"tokens_per_sec": statistics.median(rates), "max_memory_gib": max_memory_gib(device), "losses": losses,
            "peak_flops": peak_flops(device), "notes": notes}


def run_child(name: str, work: Path) -> int:
    spec = json.loads((work / "spec.json").read_text())
    run = {"ours": run_ours, "torchtitan": run_torchtitan, "transformers": run_transformers, "peft": run_peft}[name]
    result = run(spec, work)
    (work / f"{name}.json").write_text(json.dumps({**result, "spec": spec}))
    return 0


def main() -> int:
    ns = parse_args()
    return run_child(ns.child, Path(ns.work)) if ns.child else main_parent(ns)


if __name__ == "__main__":
    sys.exit(main())
