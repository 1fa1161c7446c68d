"""The tensors of an official FP8 release folder, read through an HFCheckpointReader (hf_checkpoint.open_hf_tensors
gives one for a folder whose config.json says so).

Each quantized weight `X.weight` (float8_e4m3fn) has its block scales in `X.weight_scale_inv` (fp8_blocks.py). As
a reader of the model's tensors (`keys`, `shape`, `read`) the folder looks like a bf16 release: the scales are not
keys of their own, and `read` gives a quantized weight dequantized, in fp32 (a 4-significant-bit e4m3 value times
a bf16 scale is exact there; times an fp32 scale, the exact product rounded once). `read_quantized` gives the
float8 values and their scales as stored, for a run that holds the weight in FP8.
"""

from __future__ import annotations

import torch

from .fp8_blocks import dequantize_blocks, scale_shape
from .fp8_config import SCALE_SUFFIX, kept_unquantized

FP8_DTYPE = "F8_E4M3"  # the safetensors header's name of float8_e4m3fn
_SCALE_DTYPES = ("F32", "BF16")


class Fp8ReleaseTensors:
    """`reader`'s tensors, the FP8 weights dequantized on read; `modules_to_not_convert`: the config's list. Raises
    ValueError naming every way the folder's tensors disagree with the layout (a float8 weight without scales or
    with scales of another shape or dtype, scales without their weight, a float8 tensor of a module kept
    unquantized, no float8 weight at all)."""

    def __init__(self, reader, modules_to_not_convert: list[str] | None):
        self.reader = reader
        keys = reader.keys()
        known = set(keys)
        scales = {k[: -len(SCALE_SUFFIX)]: k for k in keys if k.endswith(SCALE_SUFFIX)}
        fp8 = {k for k in keys if reader.dtype(k) == FP8_DTYPE}  # a set: 31k weights at full size are looked up
        problems = []
        if not fp8:
            problems.append("its config.json has an FP8 quantization_config but no tensor is float8 (F8_E4M3)")
        problems += [f"{k} is float8 without its {k}{SCALE_SUFFIX}" for k in sorted(fp8) if k not in scales]
        problems += [f"{s} scales {w}, which is not a float8 weight" for w, s in scales.items()
                     if w not in known or reader.dtype(w) != FP8_DTYPE]
        for weight, scale in scales.items():
            if weight in fp8 and reader.shape(scale) != scale_shape(reader.shape(weight)):
                problems.append(f"{scale} has shape {reader.shape(scale)}; {weight} {reader.shape(weight)} in 128 x "
                                f"128 blocks needs {scale_shape(reader.shape(weight))}")
            if weight in fp8 and reader.dtype(scale) not in _SCALE_DTYPES:
                problems.append(f"{scale} is {reader.dtype(scale)}, not F32 or BF16")
        problems += [f"{k} is float8 but quantization_config.modules_to_not_convert keeps its module unquantized"
                     for k in sorted(fp8) if kept_unquantized(k, modules_to_not_convert)]
        if problems:
            shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
            raise ValueError(f"not an FP8 release layout: {shown}")
        self.scales = scales

    def keys(self) -> list[str]:
        return [k for k in self.reader.keys() if not k.endswith(SCALE_SUFFIX)]

    def shape(self, key: str) -> tuple[int, ...]:
        return self.reader.shape(key)

    def read_quantized(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A quantized weight as stored: (float8_e4m3fn values, their block scales)."""
        return self.reader.read(key), self.reader.read(self.scales[key])

    def read(self, key: str, device: torch.device | str | None = None) -> torch.Tensor:
        """`key` whole, a quantized weight dequantized in fp32 on `device` (default: the host). On a GPU only the
        float8 values cross the bus, and the product is the host's bit for bit (one fp32 multiply, no FMA)."""
        if key not in self.scales:
            return self.reader.read(key).to(device)
        values, scales = self.read_quantized(key)
        return dequantize_blocks(values.to(device), scales.to(device), dtype=torch.float32)
