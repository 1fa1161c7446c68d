"""FP8 training of the blocks' dense projections (`[quantize] linear_float8_recipe`), through torchao's float8
training recipes (`pip install -e '.[fp8]'`).

Each converted projection (a models/qwen35_moe/linear.py Linear: attention's q/k/v/o, the Gated DeltaNet's
in_proj_qkv, in_proj_z and out_proj, the shared expert's gate/up/down, unless `linear_float8_filter_fqns` names it)
gets a `gemm` hook that computes F.linear's three products (y = x W^T, dx = dy W, dW = dy^T x) with their operands
cast to float8 with dynamic scales, as torchao's recipe says ("rowwise": per-row e4m3 scales rounded down to powers
of two; "rowwise_with_gw_hp": the same, dW in high precision; "tensorwise": one scale per tensor, dy in e5m2), on
the GPU's FP8 tensor cores (compute capability 8.9 or newer). The weights, their fp32 masters and optimizer state,
checkpoints and exports are what they are without it: a run may resume across the two modes. The lm_head, the
router, shared_expert_gate, in_proj_a/b and the MTP layer stay in bf16 by default (`linear_float8_filter_fqns`); a
projection whose sizes are not multiples of 16 (what FP8 GEMMs need) stays in bf16 whatever the setting.
`linear_float8_emulate` runs the same casts with the GEMMs emulated in high precision: CPU tests only.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import logging

import torch
import torch.nn.functional as F
from torch import nn

from models.qwen35_moe.linear import Linear

from .config import ConfigError

logger = logging.getLogger(__name__)

INSTALL = "pip install -e '.[fp8]' (or pip install 'torchao>=0.16')"


def float8_problems(cfg, device: torch.device) -> list[str]:
    """Why this run cannot train its projections in FP8 here; [] if it can (or does not ask to)."""
    q = cfg.quantize
    if q.linear_float8_recipe == "none":
        return []
    problems = []
    if importlib.util.find_spec("torchao") is None:
        problems.append(f"quantize.linear_float8_recipe {q.linear_float8_recipe!r} needs torchao, which is not "
                        f"installed: {INSTALL}")
    if device.type != "cuda" and not q.linear_float8_emulate:
        problems.append(f"quantize.linear_float8_recipe {q.linear_float8_recipe!r} needs a GPU with FP8 tensor cores "
                        "(compute capability 8.9 or newer); this run is on the CPU (quantize.linear_float8_emulate "
                        "true emulates the GEMMs, for tests)")
    elif device.type == "cuda" and not q.linear_float8_emulate and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        problems.append(f"quantize.linear_float8_recipe {q.linear_float8_recipe!r} needs FP8 tensor cores (compute "
                        f"capability 8.9 or newer); {torch.cuda.get_device_name(device)} is {major}.{minor}")
    return problems


class Float8Gemm:
    """F.linear(x, weight, bias) with torchao's float8 recipe `config` for its forward and backward GEMMs."""

    def __init__(self, config, in_features: int, out_features: int):
        from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

        self.config = config
        # torchao's own settings for the three GEMMs of a linear of this recipe (emulated or not, fast accumulation)
        self.mm_config = Float8Linear(in_features, out_features, bias=False, config=config,
                                      device="meta").linear_mm_config
        self._matmul = matmul_with_hp_or_float8_args

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.shape[0] % 16 or weight.shape[1] % 16:  # a piece cut under CP: FP8 GEMMs need multiples of 16
            return F.linear(x, weight, bias)
        out = self._matmul.apply(x, weight.t(), self.mm_config, self.config)
        return out if bias is None else out + bias.to(out.dtype)


def convert_to_float8(model: nn.Module, cfg, device: torch.device) -> list[str]:
    """Give the projections `cfg.quantize` selects a Float8Gemm (module docstring); returns their names. ConfigError
    naming every problem when the run cannot (float8_problems)."""
    q = cfg.quantize
    if q.linear_float8_recipe == "none":
        return []
    problems = float8_problems(cfg, device)
    if problems:
        raise ConfigError(problems)
    torchao_log = logging.getLogger("torchao")
    level = torchao_log.level  # its import warns of optional kernels (MX formats, CUTLASS) the float8 recipes never use
    torchao_log.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig
    finally:
        torchao_log.setLevel(level)

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(q.linear_float8_recipe),
                                 emulate=q.linear_float8_emulate)
    converted = []
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or any(skip in name for skip in q.linear_float8_filter_fqns):
            continue
        if module.in_features % 16 or module.out_features % 16:
            continue
        module.gemm = Float8Gemm(config, module.in_features, module.out_features)
        converted.append(name)
    logger.info("FP8 training (torchao %s, recipe %s%s): %d projections' GEMMs in float8, the others in %s",
                importlib.metadata.version("torchao"), q.linear_float8_recipe,
                ", emulated" if q.linear_float8_emulate else "", len(converted),
                "bf16" if device.type == "cuda" else "the parameters' dtype")
    return converted
