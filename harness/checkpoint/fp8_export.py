"""An export re-quantized into the FP8 release's layout (`checkpoint.export_quantized = "fp8"`, the converter's
`--quantized fp8`), so that the servers that load Qwen/Qwen3.5-35B-A3B-FP8 (vLLM, SGLang, transformers' fine-grained
FP8) load it the same way.

The export's tensors are those of the unquantized export (our text-only names), and models/qwen35_moe/fp8_layout.py
says which are stored in float8: each such weight is quantized block-wise (fp8_blocks.quantize_blocks: 128 x 128
blocks, each block's amax to 448, scales in the release's BF16) from its fp32 value (a LoRA run's W + s B A before any
rounding to `checkpoint.export_dtype`), on the device it was gathered to; a main layer's fused experts are split per
expert. The other tensors are written in `checkpoint.export_dtype`, and config.json gains the release's
quantization_config. From an FP8 base, a weight the training did not change comes back as the release stored it, bit
for bit: its block's largest value is 448 there, so quantizing value x scale finds the same scale and values again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import torch

from models.qwen35_moe.fp8_blocks import BLOCK, FP8, quantize_blocks
from models.qwen35_moe.fp8_config import SCALE_SUFFIX
from models.qwen35_moe.fp8_layout import SCALE_DTYPE, fp8_tensor_specs, quantization_config

QUANTIZED_EXPORTS = ("none", "fp8")  # checkpoint.export_quantized


class Fp8ExportTensors:
    """The tensors of `tensors` (an hf_weights.ExportTensors: the unquantized export) in the FP8 layout: `specs`,
    `fetch` for write_hf_folder, and `quantization` for config.json.

    Every HF key of `tensors` is asked for once, in the FP8 keys' order, whatever `keep` says, so that the ranks'
    collectives line up and each rank knows every scale (a weight's scales may fall in another rank's shard). A main
    layer's fused gate_up_proj is quantized as its gate and up halves (all experts at once) when the first of its
    experts is written, and the float8 halves are held until the last one is; a weight's scales are held from its
    quantization until their key is written (the next key, or a later shard's: 1/16384 of the weight's values)."""

    def __init__(self, tensors):
        self._tensors = tensors
        self.specs, self._pieces = fp8_tensor_specs(tensors.specs)
        self.quantization = quantization_config(tensors.specs)
        self._left = Counter((p.source, p.start, p.stop) for p in self._pieces.values() if p.expert is not None)
        self._parts: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._scales: dict[str, torch.Tensor] = {}

    def _quantized_expert(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A main layer's routed expert's weight `key`, quantized with its scales (its part of the fused tensor
        quantized for all experts at once, the fused tensor read when its first part is)."""
        piece = self._pieces[key]
        part = (piece.source, piece.start, piece.stop)
        if part not in self._parts:
            fused = self._tensors.value(piece.source, dtype=torch.float32)
            for source, start, stop in [p for p in self._left if p[0] == piece.source]:
                self._parts[(source, start, stop)] = quantize_blocks(fused[:, start:stop], BLOCK, SCALE_DTYPE)
            del fused
        weights, scales = self._parts[part]
        self._left[part] -= 1
        if self._left[part] == 0:
            del self._parts[part], self._left[part]
        return weights[piece.expert], scales[piece.expert]

    def _value(self, key: str, keep: bool) -> torch.Tensor | None:
        if key.endswith(SCALE_SUFFIX) and key not in self._pieces:
            return self._scales.pop(key)
        if self.specs[key][0] != FP8:
            return self._tensors.value(self._pieces[key].source, keep)
        if self._pieces[key].expert is not None:
            weight, self._scales[key + SCALE_SUFFIX] = self._quantized_expert(key)
        else:
            fp32 = self._tensors.value(key, dtype=torch.float32)
            weight, self._scales[key + SCALE_SUFFIX] = quantize_blocks(fp32, BLOCK, SCALE_DTYPE)
        return weight

    def fetch(self, keys: list[str], keep: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
        for key in keys:
            value = self._value(key, keep)
            yield key, value.to("cpu") if keep and value is not None else None
