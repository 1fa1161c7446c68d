"""What re-quantizing a model into the FP8 release's layout costs in accuracy, on one GPU: the logits of a fixed batch
from an unquantized HF folder (a LoRA run's merged export, or the bf16 base itself) against those of the same model
with every weight the FP8 layout quantizes replaced by its block-quantized value, which is what
`checkpoint.export_quantized fp8` writes (models/qwen35_moe/fp8_layout.py, fp8_blocks.quantize_blocks; per expert,
gate and up apart). The model is read tensor by tensor (host memory stays at one tensor), the MTP layer left out.

    python benchmarks/fp8_export_error.py /dev/shm/run/hf [--rows 2] [--tokens 1024] [--seed 0]

Prints the logits' relative L2 error, the largest error against the largest logit, the top-1 agreement and the mean
KL divergence of the next-token distributions (bf16 model's to the quantized one's).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.checkpoint.hf_weights import load_hf_weights  # noqa: E402
from models.qwen35_moe import Qwen35MoeArgs, Qwen35MoeModel, Qwen35MoeStateDictAdapter  # noqa: E402
from models.qwen35_moe.fp8_blocks import FP8, dequantize_blocks, quantize_blocks  # noqa: E402
from models.qwen35_moe.fp8_layout import SCALE_DTYPE, fp8_tensor_specs  # noqa: E402
from models.qwen35_moe.hooks import canonical_name  # noqa: E402


def quantized_weights(model: Qwen35MoeModel, args: Qwen35MoeArgs) -> dict[str, tuple[torch.Tensor, int]]:
    """{native key: (parameter, parts)} of the weights the FP8 layout quantizes; `parts` 2 for the fused gate/up
    (each half quantized apart, as the export splits them)."""
    adapter = Qwen35MoeStateDictAdapter(args)
    params = {canonical_name(k): p for k, p in model.named_parameters()}
    hf_of = {key: adapter.to_hf_shapes(key, tuple(p.shape)) for key, p in params.items()}
    specs = {hf: (torch.bfloat16, shape) for shapes in hf_of.values() for hf, shape in shapes.items()}
    fp8_specs, pieces = fp8_tensor_specs(specs)
    quantized = {pieces[k].source for k, (dtype, _) in fp8_specs.items() if dtype == FP8}
    return {key: (params[key], 2 if key.endswith("experts.gate_up_proj") else 1)
            for key, shapes in hf_of.items() if quantized & shapes.keys()}


@torch.no_grad()
def requantize(weight: torch.Tensor, parts: int) -> None:
    """`weight` replaced by its block-quantized value (leading dims, the experts, blocked apart)."""
    for part in weight.chunk(parts, dim=-2):
        part.copy_(dequantize_blocks(*quantize_blocks(part, scale_dtype=SCALE_DTYPE), dtype=part.dtype))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", help="an unquantized HF folder of the model")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda")
    ns = parser.parse_args()
    args = dataclasses.replace(Qwen35MoeArgs.from_hf_config(ns.folder), mtp_num_hidden_layers=0)
    started = time.perf_counter()
    with torch.device("meta"):
        model = Qwen35MoeModel(args)
    model.to(torch.bfloat16)
    model.to_empty(device=ns.device)
    load_hf_weights(model, args, ns.folder)
    model.eval()
    print(f"loaded {ns.folder} in {time.perf_counter() - started:.0f} s", flush=True)
    ids = torch.randint(0, args.vocab_size, (ns.rows, ns.tokens), generator=torch.Generator().manual_seed(ns.seed))
    ids = ids.to(ns.device)
    with torch.no_grad():
        reference = model(ids).logits.float().cpu()
    started = time.perf_counter()
    weights = quantized_weights(model, args)
    for weight, parts in weights.values():
        requantize(weight, parts)
    if ns.device == "cuda":
        torch.cuda.synchronize()
    print(f"re-quantized {len(weights)} weights ({sum(w.numel() for w, _ in weights.values()) / 1e9:.2f}B values) "
          f"in {time.perf_counter() - started:.1f} s", flush=True)
    with torch.no_grad():
        quantized = model(ids).logits.float().cpu()
    error = (quantized - reference).norm() / reference.norm()
    largest = (quantized - reference).abs().max() / reference.abs().max()
    top1 = (quantized.argmax(-1) == reference.argmax(-1)).float().mean()
    kl = torch.nn.functional.kl_div(quantized.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1).mean()
    print(f"fp8 re-quantization, {ns.rows} x {ns.tokens} tokens: logits relative L2 error {error:.4%}, largest "
          f"error {largest:.4%} of the largest |logit|, top-1 agreement {top1:.2%}, mean KL {kl:.3e} nats")
    return 0


if __name__ == "__main__":
    sys.exit(main())
