"""Per-GPU memory of a training configuration, predicted from parameter counts, and which Qwen3.5-35B-A3B
configurations fit.

    python benchmarks/memory_model.py                 # the table for 35B-A3B (docs/performance.md, "Memory model")
    python benchmarks/memory_model.py --check         # the prediction against the peaks measured on GPU

The terms (bytes per GPU; S = dp_shard * cp ranks share the parameters, bf16 compute, fp32 master weights):
- states: 16 B per parameter / S: fp32 weights, fp32 gradients, AdamW's two fp32 moments (FSDP shards them all;
  the experts over ep * efsdp = S ranks as well, so EP does not change this term);
- gathered: GATHER_BYTES per parameter of one block: FSDP's all-gathered bf16 weights of the block in use and
  the prefetched one, and in backward their gradients on their way to the reduce-scatter; under EP a block
  gathers only its E / ep local experts;
- activations: per token on this GPU, WORKING_BYTES for the block being recomputed (full AC; under LoRA,
  LORA_WORKING_BYTES) and the saved inputs, 2 B x hidden each: compiled, full AC checkpoints each block in two
  halves (two inputs a block, parallel/activation_checkpointing.py; eager, one: the model then over-predicts by
  2 B x hidden a block);
  without AC, LAYER_BYTES for every block, plus, counted not fitted (the fitted peaks were measured before FLA's
  function kept them), the chunk states FLA's function keeps for its backward
  (models/qwen35_moe/kernels/fla_saved_states.py) in every Gated DeltaNet layer. (With full AC only the recomputed block
  holds them, as FLA's backward held the same tensors when it recomputed them: not counted.)
- FIXED: the rest (the gathered lm_head, the chunked cross entropy's one chunk of logits, CUDA context and NCCL
  buffers), fitted. Every peak here was measured with the embedding and the lm_head as FSDP units.
  Vocabulary-parallel (`parallelism.vocab_parallel`, taken by "auto" where shard ranks x tokens per rank <=
  vocabulary) they are never gathered, and the model over-predicts such runs (docs/performance.md, "Memory
  model", with the other changes since the peaks were measured).
Fitted on measured peaks: WORKING_BYTES and FIXED on CP=1 at 32k and 64k (4 layers, 16 experts, full AC: slope
and intercept over tokens), GATHER_BYTES on FSDP=2 against EP=2 with 256 experts (the difference is the experts
EP does not gather), LAYER_BYTES on one run without AC. Every peak in MEASURED is then predicted (`--check`).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_model import bench_args  # noqa: E402

from models.qwen35_moe import Qwen35MoeArgs, Qwen35MoeModel, get_flavor  # noqa: E402
from models.qwen35_moe.kernels.linear_cross_entropy import CHUNK_TOKENS  # noqa: E402
from models.qwen35_moe.lora_targets import LoraArgs  # noqa: E402
from models.qwen35_moe.sizes import adapter_count  # noqa: E402

GIB = 1024**3
WORKING_BYTES = 367_000  # per token: (34.7 - 23.0) GiB / 32k tokens, less the 4 saved block inputs (16 KiB)
GATHER_BYTES = 5  # per block parameter: (39.3 - 37.4) GiB / the 403M expert parameters EP=2 does not gather
FIXED_GIB = 0.8  # 23.0 GiB at 32k less the states (10.1 GiB), the gathered block (0.4 GiB) and the activations
LAYER_BYTES = 263_000  # per token and block without AC: 8 layers, 32 experts, 8k tokens on one GPU, 49.1 GiB
# per token, WORKING_BYTES's place under LoRA: the recomputed block's frozen GEMMs keep no inputs for weight
# gradients. Fitted on MEASURED_LORA's 7 peaks (worst 3.3%; each held out of the fit in turn, within 4.3% of it)
LORA_WORKING_BYTES = 29_000
FITTED_LOGITS = 2048  # tokens of logits alive at the loss in every peak of MEASURED (FIXED_GIB holds them): what a
# loss chunk of 2048 holds, the loss keeping one chunk's logits alive at a time
LOGIT_BYTES = 2  # per token of the loss chunk and vocabulary entry: bf16 logits, their gradient written in place


@dataclass(frozen=True)
class Setup:
    gpus: int
    ep: int = 1
    cp: int = 1
    replicate: int = 1
    seq: int = 4096
    local_batch: int = 1
    ac: str = "full"
    lora_rank: int = 0  # LoRA on lora.py's default targets; 0: a full fine-tune
    expert_rank: int = 0  # LoRA's lora.expert_rank (0: lora_rank)
    accumulate: bool = False  # more than one micro-batch a step: LoRA's fp32 gradients held apart from the bf16 copies
    mtp_on_host: bool = True  # one GPU, LoRA: the frozen MTP layer held on the host (harness/model_setup.py)
    loss_chunk: int = CHUNK_TOKENS  # training.loss_chunk_tokens
    fp8_base: bool = False  # LoRA from the FP8 release, its quantized weights held in float8 (1 B and block scales)


def parameter_counts(args: Qwen35MoeArgs) -> dict[str, int]:
    with torch.device("meta"):
        model = Qwen35MoeModel(args)
    named = list(model.named_parameters())
    experts = sum(p.numel() for n, p in named if ".experts." in n)
    root = sum(p.numel() for n, p in named if not n.startswith("layers."))
    mtp = sum(p.numel() for n, p in named if n.startswith("mtp."))
    # What the FP8 release quantizes: the 2-D Linear weights but the embedding, lm_head and each layer's router,
    # shared_expert_gate and linear_attn.in_proj_a / in_proj_b (scripts/make_release_checkpoint.py's
    # modules_to_not_convert); per part, as the MTP's share is held apart.
    kept = (".embed_tokens.", "lm_head.", ".gate.", ".shared_expert_gate.", ".in_proj_a.", ".in_proj_b.")
    fp8 = [(n, p.numel()) for n, p in named if p.ndim >= 2 and not any(k in f".{n}" for k in kept)]
    return {"total": sum(p.numel() for _, p in named), "experts": experts, "root": root, "mtp": mtp,
            "fp8": sum(c for _, c in fp8), "fp8_mtp": sum(c for n, c in fp8 if n.startswith("mtp."))}


def fla_state_bytes(args: Qwen35MoeArgs) -> int:
    """Per token and Gated DeltaNet layer: w and v_new (bf16, per value head Dk and Dv) and the state h (bf16,
    Dk x Dv per value head, one per 64-token chunk). 32 KiB at 35B-A3B's 32 heads of 128."""
    heads, dk, dv = args.linear_num_value_heads, args.linear_key_head_dim, args.linear_value_head_dim
    return 2 * heads * (dk + dv) + 2 * heads * dk * dv // 64


def predict_gib(args: Qwen35MoeArgs, s: Setup) -> float:
    counts = parameter_counts(args)
    layers = args.num_hidden_layers
    shards = s.gpus // s.replicate
    states = 16 * counts["total"] / shards
    block_dense = (counts["total"] - counts["experts"] - counts["root"]) / layers
    block = block_dense + counts["experts"] / layers / s.ep
    gathered = GATHER_BYTES * block
    if s.lora_rank:  # the base frozen in bf16 (2 B); an adapter parameter 16 B: fp32 weight, its bf16 copy holding
        # the gradient, AdamW's two fp32 moments; 18 B with accumulation (an fp32 gradient beside the copy)
        lora = LoraArgs(rank=s.lora_rank, alpha=2.0 * s.lora_rank, expert_rank=s.expert_rank)
        on_host = s.mtp_on_host and shards == 1
        frozen = counts["total"] - (counts["mtp"] if on_host else 0)
        base = 2 * frozen
        if s.fp8_base:  # a quantized weight 1 B (and 4 B of scale per 128 x 128 block) instead of bf16's 2
            quantized = counts["fp8"] - (counts["fp8_mtp"] if on_host else 0)
            base -= quantized * (1 - 4 / 128**2)
        states = (base + (18 if s.accumulate else 16) * adapter_count(args, lora)) / shards
        gathered = 0 if shards == 1 else gathered  # one GPU: no FSDP, nothing gathered
    tokens = s.seq * s.local_batch // s.cp
    gdn_layers = sum(t == "linear_attention" for t in args.layer_types)
    if s.ac == "none":
        activations = tokens * (layers * LAYER_BYTES + gdn_layers * fla_state_bytes(args))
    else:
        working = LORA_WORKING_BYTES if s.lora_rank else WORKING_BYTES
        activations = tokens * (working + layers * 2 * 2 * args.hidden_size)
    chunk_tokens = min(s.loss_chunk, tokens) if s.loss_chunk > 0 else tokens  # 0: all the rank's tokens at once
    chunk = (chunk_tokens - FITTED_LOGITS) * args.vocab_size * LOGIT_BYTES
    return (states + gathered + activations + chunk) / GIB + FIXED_GIB


def Fitted(**kwargs) -> Setup:  # noqa: N802 (reads as the Setup it makes)
    """A setup as the peaks below were measured: the logits their loss held (FITTED_LOGITS)."""
    return Setup(loss_chunk=FITTED_LOGITS, **kwargs)


# Peaks measured on H200s (benchmarks/train_throughput.py and hf_baseline.py, qwen35_moe.toml otherwise: full AC,
# local batch 1): (layers, experts, setup, GiB). The gpus=1 peaks ran FSDP on one rank, and all ran before FLA's
# chunk states were kept for the backward: docs/performance.md, "Memory model", gives what each change moves.
MEASURED = [
    (4, 16, Fitted(gpus=2, seq=32768), 23.0),
    (4, 16, Fitted(gpus=2, seq=65536), 34.7),
    (4, 16, Fitted(gpus=2, cp=2, seq=65536), 23.2),
    (4, 16, Fitted(gpus=2, cp=2, seq=131072), 35.0),
    (4, 256, Fitted(gpus=2), 39.3),
    (4, 256, Fitted(gpus=2, ep=2), 37.4),
    (8, 32, Fitted(gpus=1, local_batch=2), 35.2),
    (8, 32, Fitted(gpus=1, local_batch=2, ac="none"), 49.1),
    (8, 32, Fitted(gpus=2, local_batch=2, ac="none"), 37.6),
    # 4 x H200 (benchmarks/composed_mesh.py), not used in the fit
    (4, 256, Fitted(gpus=1, local_batch=2), 76.5),
    (4, 256, Fitted(gpus=2, cp=2, ep=2, local_batch=2), 37.4),
    (4, 256, Fitted(gpus=4, cp=2, ep=2, local_batch=2), 21.1),
    (4, 256, Fitted(gpus=4, replicate=2), 39.3),
    (4, 16, Fitted(gpus=2, cp=2, seq=524288), 106.4),
    (4, 256, Fitted(gpus=4), 24.7),
    (4, 256, Fitted(gpus=4, ep=4), 21.1),
    (4, 16, Fitted(gpus=4, cp=4, seq=1048576), 104.6),
    # 4 x H200, compiled, after those changes (docs/performance.md, "256 experts over 4 GPUs"), not used in the fit
    # (EP: the dispatch that gathers only this rank's assignment rows)
    (8, 256, Fitted(gpus=4, ep=4, local_batch=4), 36.8),
    (8, 256, Fitted(gpus=4, ep=4, local_batch=8), 45.2),
    (8, 256, Fitted(gpus=4, local_batch=4), 42.3),
    (8, 256, Fitted(gpus=4, local_batch=8), 46.1),
    (20, 256, Fitted(gpus=4, ep=4, local_batch=4), 74.4),
    (20, 256, Fitted(gpus=4, ep=4, local_batch=8), 82.9),
]

# LoRA of the full-size 35B-A3B on one GPU (benchmarks/lora_one_gpu.py, full AC, compiled, 4096-token chat rows),
# LORA_WORKING_BYTES's fit: (setup, GiB allocated at the peak)
MEASURED_LORA = [
    (Setup(gpus=1, lora_rank=16, local_batch=4, mtp_on_host=False), 84.6),  # H200, qwen35_moe_lora.toml
    (Setup(gpus=1, lora_rank=16, expert_rank=8, accumulate=True), 77.0),  # H100, qwen35_moe_lora_80gb.toml, chunk 4096
    (Setup(gpus=1, lora_rank=16, expert_rank=8, accumulate=True, loss_chunk=1024), 75.5),  # H100, the 80gb config
    # H100, from the FP8 release's layout, long chats: qwen35_moe_lora.toml at 4 rows a step, its base held in FP8;
    # the 80gb config at 1 row a step, the base in FP8 and dequantized to bf16; at 2 rows a step under a 46 GiB cap
    (Setup(gpus=1, lora_rank=16, local_batch=4, fp8_base=True), 53.8),
    (Setup(gpus=1, lora_rank=16, expert_rank=8, loss_chunk=1024, fp8_base=True), 43.2),
    (Setup(gpus=1, lora_rank=16, expert_rank=8, loss_chunk=1024), 73.7),
    (Setup(gpus=1, lora_rank=16, expert_rank=8, accumulate=True, loss_chunk=1024, fp8_base=True), 44.5),
]

RECIPES = [  # (GPUs x GiB, setup): the 35B-A3B table
    ("8 x 80 GB", Setup(gpus=8, ep=8)),
    ("8 x 80 GB", Setup(gpus=8, ep=8, seq=8192)),
    ("16 x 80 GB", Setup(gpus=16, ep=8, seq=8192)),
    ("16 x 80 GB", Setup(gpus=16, ep=8, cp=2, seq=32768)),
    ("8 x 141 GB", Setup(gpus=8, ep=8, seq=16384)),
    ("8 x 141 GB", Setup(gpus=8, ep=8, cp=2, seq=65536)),
    ("8 x 141 GB", Setup(gpus=8, ep=8, cp=4, seq=131072)),
    ("8 x 141 GB", Setup(gpus=8, ep=8, ac="none", seq=4096)),
    ("1 x 141 GB", Setup(gpus=1, lora_rank=16)),  # LoRA, train_configs/qwen35_moe_lora.toml
    ("1 x 141 GB", Setup(gpus=1, lora_rank=16, local_batch=4)),
    ("1 x 80 GB", Setup(gpus=1, lora_rank=16, expert_rank=8, accumulate=True, loss_chunk=1024)),  # *_lora_80gb.toml
    # LoRA from the FP8 release (its quantized weights held in float8): qwen35_moe_lora.toml as is; the 80gb config
    # as is, and at 2 rows a step without accumulation (a 48 GB card)
    ("1 x 80 GB", Setup(gpus=1, lora_rank=16, local_batch=4, accumulate=True, fp8_base=True)),
    ("1 x 48 GB", Setup(gpus=1, lora_rank=16, expert_rank=8, accumulate=True, loss_chunk=1024, fp8_base=True)),
    ("1 x 48 GB", Setup(gpus=1, lora_rank=16, expert_rank=8, local_batch=2, loss_chunk=1024, fp8_base=True)),
    # qwen35_moe_lora.toml as is under FSDP over two 48 GB cards: the FP8 base held (sharded float8), or dequantized
    ("2 x 48 GB", Setup(gpus=2, lora_rank=16, local_batch=4, accumulate=True, fp8_base=True)),
    ("2 x 48 GB", Setup(gpus=2, lora_rank=16, local_batch=4, accumulate=True)),
]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="predictions against the measured peaks")
    ns = parser.parse_args()
    if ns.check:
        for layers, experts, setup, measured in MEASURED:
            predicted = predict_gib(bench_args(layers, experts), setup)
            print(f"{layers}L/{experts}E {setup}: predicted {predicted:.1f} GiB, measured {measured:.1f} GiB "
                  f"({predicted / measured - 1:+.0%})")
        for setup, measured in MEASURED_LORA:
            predicted = predict_gib(get_flavor("35B-A3B"), setup)
            print(f"35B-A3B LoRA {setup}: predicted {predicted:.1f} GiB, measured {measured:.1f} GiB "
                  f"({predicted / measured - 1:+.1%})")
        return 0
    args = get_flavor("35B-A3B")
    counts = parameter_counts(args)
    print(f"Qwen3.5-35B-A3B: {counts['total'] / 1e9:.1f}B parameters ({counts['experts'] / 1e9:.1f}B in routed "
          f"experts); per-GPU memory predicted:")
    for gpus, setup in RECIPES:
        print(f"  {gpus:11s} {setup}: {predict_gib(args, setup):.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
