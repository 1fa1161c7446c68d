"""FP8 training (`[quantize]`) through torchao's float8 training recipes (`pip install -e '.[fp8]'`): the blocks' dense
projections (`linear_float8_recipe`) and the routed experts' grouped GEMMs (`grouped_mm_float8_fqns`).

Each converted projection (a models/qwen35_moe/linear.py Linear: attention's q/k/v/o, the Gated DeltaNet's
in_proj_qkv, in_proj_z and out_proj, the shared expert's gate/up/down, unless `linear_float8_filter_fqns` names it)
gets a `gemm` hook that computes F.linear's three products (y = x W^T, dx = dy W, dW = dy^T x) with their operands
cast to float8 with dynamic scales, as torchao's recipe says ("rowwise": per-row e4m3 scales rounded down to powers
of two, each operand scaled along its product's contraction; "rowwise_with_gw_hp": the same, dW in high precision;
"tensorwise": one scale per tensor, dy in e5m2), on the GPU's FP8 tensor cores (compute capability 8.9 or newer).
The lm_head, the router, shared_expert_gate, in_proj_a/b and the MTP layer stay in bf16 by default; a projection
whose sizes are not multiples of 16 (what FP8 GEMMs need) stays in bf16 whatever the setting.

Converted routed experts (models/qwen35_moe/moe.py RoutedExperts, `gemms` hook) run torchao's rowwise FP8 grouped
GEMM, which is each expert's dense rowwise recipe (x per token, the weight per output row; dy per token, the weight
per input column; dW from dy and x per column over the expert's tokens), and which needs every expert's token group
to start at a multiple of 16 rows: the tokens are laid out so (`aligned_groups`, zero rows between the groups) and
back. On the loop path (CPU) each expert's two products go through the dense recipe, the same numbers.

The weights, their fp32 masters and optimizer state, checkpoints and exports are what they are without FP8: a run
may resume across the modes. `float8_emulate` runs the same casts with the GEMMs emulated in high precision: CPU
tests only.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import logging
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.qwen35_moe.linear import Linear
from models.qwen35_moe.moe import RoutedExperts

from .config import ConfigError

logger = logging.getLogger(__name__)

INSTALL = "pip install -e '.[fp8]' (or pip install 'torchao>=0.16')"
ALIGN = 16  # rows: where torchao's FP8 grouped GEMM needs each token group to start


def _asked(q) -> str:
    """The settings that ask for FP8, as the error lines name them, with their verb: '... need' or '... needs'."""
    names = [name for name, on in (("quantize.linear_float8_recipe", q.linear_float8_recipe != "none"),
                                   ("quantize.grouped_mm_float8_fqns", bool(q.grouped_mm_float8_fqns))) if on]
    return "" if not names else " and ".join(names) + (" need" if len(names) > 1 else " needs")


def float8_problems(cfg, device: torch.device) -> list[str]:
    """Why this run cannot train in FP8 here; [] if it can (or does not ask to)."""
    q = cfg.quantize
    asked = _asked(q)
    if not asked:
        return []
    problems = []
    if importlib.util.find_spec("torchao") is None:
        problems.append(f"{asked} torchao, which is not installed: {INSTALL}")
    if device.type != "cuda" and not q.float8_emulate:
        problems.append(f"{asked} a GPU with FP8 tensor cores (compute capability 8.9 or newer); this run is on "
                        "the CPU (quantize.float8_emulate true emulates the GEMMs, for tests)")
    elif device.type == "cuda" and not q.float8_emulate and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        problems.append(f"{asked} FP8 tensor cores (compute capability 8.9 or newer); "
                        f"{torch.cuda.get_device_name(device)} is {major}.{minor}")
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
        if weight.shape[0] % 16 or weight.shape[1] % 16 or x.numel() == 0:  # a piece cut under CP, or no tokens
            return F.linear(x, weight, bias)
        out = self._matmul.apply(x, weight.t(), self.mm_config, self.config)
        return out if bias is None else out + bias.to(out.dtype)


def aligned_groups(x: torch.Tensor, offsets: torch.Tensor, align: int = ALIGN
                   ) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """x's rows (M, D), in groups ending at `offsets` (E,), laid out with each group starting at a multiple of
    `align` rows, zero rows between: (that layout, M + align * E rows whatever the groups' sizes, so no host sync and
    no recompile; its groups' end offsets, int32; the function taking rows of that layout back to x's). Rows of x
    past offsets[-1] (no expert's, under expert parallelism) come back unspecified."""
    ends = offsets.long()
    counts = ends - F.pad(ends[:-1], (1, 0))
    starts = ends - counts
    padded_counts = (counts + align - 1) // align * align
    padded_ends = padded_counts.cumsum(0)
    padded_starts = padded_ends - padded_counts
    rows = x.shape[0] + align * offsets.shape[0]
    at = torch.arange(rows, device=x.device)
    group = torch.searchsorted(padded_ends, at, right=True).clamp(max=offsets.shape[0] - 1)
    within = at - padded_starts[group]
    filled = within < counts[group]  # (the groups' last padded end: within >= counts past it)
    padded = torch.where(filled[:, None], x[torch.where(filled, starts[group] + within, 0)], 0)
    back = torch.arange(x.shape[0], device=x.device)
    group = torch.searchsorted(ends, back, right=True).clamp(max=offsets.shape[0] - 1)
    target = (padded_starts[group] + back - starts[group]).clamp(max=rows - 1)
    return padded, padded_ends.to(torch.int32), lambda out: out[target]


class Float8ExpertGemms:
    """A RoutedExperts' `gemms` (models/qwen35_moe/moe.py) in FP8, torchao's rowwise recipe (module docstring)."""

    def __init__(self, config, on_gpu: bool):
        self.config = config
        self._dense: dict[tuple[int, int], Float8Gemm] = {}
        self._grouped = None
        if on_gpu:  # its Triton kernels: imported here, not in a compiled block's trace (and never on a CPU)
            from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

            self._grouped = _to_fp8_rowwise_then_scaled_grouped_mm

    def aligned(self, x: torch.Tensor, offsets: torch.Tensor):
        return aligned_groups(x, offsets)

    def grouped(self, x: torch.Tensor, weight_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self._grouped(x, weight_t, offsets, out_dtype=x.dtype, pad_token_groups_for_grouped_mm=False)

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """One expert's product on the loop path: the dense rowwise recipe (the grouped GEMM's, per expert)."""
        out_features, in_features = weight.shape
        if (in_features, out_features) not in self._dense:
            self._dense[(in_features, out_features)] = Float8Gemm(self.config, in_features, out_features)
        return self._dense[(in_features, out_features)](x, weight)


def _recipe(name: str, emulate: bool):
    torchao_log = logging.getLogger("torchao")
    level = torchao_log.level  # its import warns of optional kernels (MX formats, CUTLASS) the float8 recipes never use
    torchao_log.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig
    finally:
        torchao_log.setLevel(level)
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(name), emulate=emulate)


def convert_to_float8(model: nn.Module, cfg, device: torch.device) -> list[str]:
    """Give the projections and routed experts `cfg.quantize` selects their FP8 GEMMs (module docstring); returns
    their names. ConfigError naming every problem when the run cannot (float8_problems)."""
    q = cfg.quantize
    if not _asked(q):
        return []
    modules = list(model.named_modules())
    linears = [(name, module) for name, module in modules if q.linear_float8_recipe != "none"
               and isinstance(module, Linear) and not any(skip in name for skip in q.linear_float8_filter_fqns)
               and module.in_features % 16 == 0 and module.out_features % 16 == 0]
    experts = [(name, module) for name, module in modules if isinstance(module, RoutedExperts)
               and any(fqn in name for fqn in q.grouped_mm_float8_fqns)]
    problems = float8_problems(cfg, device)
    if q.linear_float8_recipe != "none" and not linears:  # a filter that takes every projection: a slip, not a plan
        problems.append(f"quantize.linear_float8_recipe {q.linear_float8_recipe!r} converts no projection: "
                        f"quantize.linear_float8_filter_fqns {q.linear_float8_filter_fqns} keeps every one in bf16")
    if q.grouped_mm_float8_fqns and not experts:
        names = sorted({re.sub(r"\.\d+\.", ".N.", name) for name, module in modules if isinstance(module, RoutedExperts)})
        problems.append(f"quantize.grouped_mm_float8_fqns {q.grouped_mm_float8_fqns} names none of the routed "
                        f"experts' modules ({', '.join(names)}; an entry matches a part of the name, e.g. 'experts')")
    if problems:
        raise ConfigError(problems)
    if linears:
        config = _recipe(q.linear_float8_recipe, q.float8_emulate)
        for _, module in linears:
            module.gemm = Float8Gemm(config, module.in_features, module.out_features)
    if experts:
        config = _recipe("rowwise", q.float8_emulate)
        for _, module in experts:
            module.gemms = Float8ExpertGemms(config, device.type == "cuda")
    logger.info("FP8 training (torchao %s%s): %d projections' GEMMs in float8 (recipe %s), %d routed experts' "
                "(rowwise); the rest in %s", importlib.metadata.version("torchao"),
                ", emulated" if q.float8_emulate else "", len(linears), q.linear_float8_recipe, len(experts),
                "bf16" if device.type == "cuda" else "the parameters' dtype")
    return [name for name, _ in linears + experts]
