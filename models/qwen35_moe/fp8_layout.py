"""Which tensors an FP8 release stores in float8, and under which names: the layout of Qwen/Qwen3.5-35B-A3B-FP8
(DeepSeek-V3's block-wise "fp8" scheme), as a map from the BF16 layout's tensors. Both writers of that layout use it:
scripts/make_release_checkpoint.py --fp8 (a release-shaped folder with random weights, multimodal names) and the
quantized export (harness/checkpoint/fp8_export.py, our text-only names).

- The main layers' routed experts are stored per expert (`...mlp.experts.{e}.{gate,up,down}_proj.weight`, gate =
  gate_up_proj[e, :I], up = gate_up_proj[e, I:], down = down_proj[e]) where the BF16 layout fuses them; the MTP
  layer's are per expert in both.
- Every 2-D `.weight` outside `modules_to_not_convert` is float8_e4m3fn, with `<module>.weight_scale_inv` beside it:
  one scale per 128 x 128 block (fp8_blocks.py), in SCALE_DTYPE.
- Kept as they are: lm_head, the embedding, in every layer (the MTP's too) the router, shared_expert_gate and
  linear_attn.in_proj_a/b, mtp.fc, the vision tower; and every tensor that is not a 2-D weight (norms, conv1d,
  A_log, dt_bias).
"""

from __future__ import annotations

import dataclasses
import re

import torch

from .fp8_blocks import BLOCK, FP8, scale_shape
from .fp8_config import SCALE_SUFFIX, kept_unquantized

# The FP8 release stores its block scales in BF16; DeepSeek-V3's checkpoints and transformers' fine-grained FP8
# quantizer write them in float32: a reader must accept both (fp8_release.py does).
SCALE_DTYPE = torch.bfloat16
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK]}  # and modules_to_not_convert
# Modules of every layer (main and MTP) that the FP8 release keeps unquantized.
KEPT_IN_LAYERS = (".mlp.gate", ".mlp.shared_expert_gate", ".linear_attn.in_proj_a", ".linear_attn.in_proj_b")
_FUSED_EXPERTS = re.compile(r"^(model\.(?:language_model\.)?layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")

Specs = dict[str, tuple[torch.dtype, tuple[int, ...]]]


@dataclasses.dataclass(frozen=True)
class Piece:
    """Where a tensor of the FP8 layout takes its value: the BF16 tensor `source`, or rows start:stop of one expert of
    it (a main layer's fused experts)."""

    source: str
    expert: int | None = None
    start: int = 0
    stop: int = 0


def modules_to_not_convert(specs: Specs) -> list[str]:
    """quantization_config.modules_to_not_convert for the BF16 layout's tensors `specs` (the exact names and order of
    the release's own list are not confirmed): lm_head and the embedding, then every main layer's router,
    shared_expert_gate and linear_attn.in_proj_a/b by layer, mtp.fc and the MTP layers' likewise, and the vision tower
    (where there is one). A module's tensors are `<module>.<name>`."""
    modules = [name.removesuffix(".weight") for name in specs if name.endswith(".weight")]
    in_layers = sorted((m for m in modules if m.endswith(KEPT_IN_LAYERS) and not m.startswith("model.visual.")),
                       key=lambda m: (int(re.search(r"layers\.(\d+)\.", m).group(1)), m))  # whatever order `specs` has
    embedding = [m for m in modules if m.endswith(".embed_tokens") and not m.startswith("mtp.")]
    mtp_fc = [m for m in modules if m == "mtp.fc"]
    visual = ["model.visual"] if any(name.startswith("model.visual.") for name in specs) else []
    return ["lm_head", *embedding, *(m for m in in_layers if not m.startswith("mtp.")), *mtp_fc,
            *(m for m in in_layers if m.startswith("mtp.")), *visual]


def quantization_config(specs: Specs) -> dict:
    """config.json's quantization_config for the BF16 layout's tensors `specs`."""
    return {**QUANTIZATION, "modules_to_not_convert": modules_to_not_convert(specs)}


def fp8_tensor_specs(specs: Specs) -> tuple[Specs, dict[str, Piece]]:
    """The FP8 layout's tensors from the BF16 layout's `specs` (module docstring): ({name: (dtype, shape)}, {name: its
    Piece}, the scales having none). Each quantized weight is float8 with its `weight_scale_inv`; the rest keeps its
    dtype."""
    kept = modules_to_not_convert(specs)
    out, pieces = {}, {}
    for name, (dtype, shape) in specs.items():
        fused = _FUSED_EXPERTS.match(name)
        if fused is None:
            parts = {name: (Piece(name), shape)}
        else:
            base, kind = fused.groups()
            experts, rows, cols = shape
            halves = ({"gate_proj": (0, rows // 2), "up_proj": (rows // 2, rows)} if kind == "gate_up_proj"
                      else {"down_proj": (0, rows)})
            parts = {f"{base}.{e}.{part}.weight": (Piece(name, e, start, stop), (stop - start, cols))
                     for e in range(experts) for part, (start, stop) in halves.items()}
        for part, (piece, part_shape) in parts.items():
            pieces[part] = piece
            module = part.removesuffix(".weight")
            if module != part and len(part_shape) == 2 and not kept_unquantized(part, kept):
                out[part] = (FP8, part_shape)
                out[part + SCALE_SUFFIX] = (SCALE_DTYPE, scale_shape(part_shape, BLOCK))
            else:
                out[part] = (dtype, part_shape)
    return out, pieces
