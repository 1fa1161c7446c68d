"""LoRA (Hu et al., 2021): a trained low-rank update beside each targeted projection of a frozen model.

A targeted projection W (out, in) computes W x + s * B (A x), s = alpha / rank, A (rank, in) drawn at random and
B (out, rank) zero, so training starts from the base model exactly. Only A and B train (fp32 master weights and
AdamW state); the base weights keep no gradient, no optimizer state and no fp32 copy: the trainer holds them in the
compute dtype (`hold_frozen_in`, which the trainer's LoRA part calls: harness/lora/run.py).

The adapters enter the model through one declared extension point, the `adapter` of each Linear, TopKRouter and
RoutedExperts (None, the default, leaves the model plain; hooks.py). The routed experts get one pair per expert
on the fused gate/up projection and one on the down projection, run as grouped GEMMs beside the base's (moe.py),
never as a loop over experts on the GPU.

Which modules can be targeted, and how the adapters' keys are named: lora_targets.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .args import Qwen35MoeArgs
from .fp8_hold import hold_fp8
from .hooks import canonical_name
from .linear import Linear
from .lora_targets import DENSE_TARGETS, LoraArgs, is_adapter_key
from .model import Qwen35MoeModel
from .moe import RoutedExperts, TopKRouter


class LowRank(nn.Module):
    """The update of one dense projection: x -> s * B (A dropout(x))."""

    def __init__(self, in_features: int, out_features: int, args: LoraArgs):
        super().__init__()
        self.scale = args.scale
        self.lora_A = nn.Parameter(torch.empty(args.rank, in_features))
        self.lora_B = nn.Parameter(torch.empty(out_features, args.rank))
        self.dropout = nn.Dropout(args.dropout) if args.dropout else nn.Identity()

    def forward(self, x: torch.Tensor, rows=None, columns=None) -> torch.Tensor:
        """`rows` / `columns` (Linear.part): the update of the base weight's rows / columns they cut."""
        a, b = self.lora_A.to(x.dtype), self.lora_B.to(x.dtype)
        low = F.linear(self.dropout(x), a if columns is None else columns(a)) * self.scale  # scaled rank-wide
        return F.linear(low, b if rows is None else rows(b))


class ExpertLowRank(nn.Module):
    """The updates of the routed experts: per expert e, s * B_e A_e on the fused gate/up projection (2I, D) and on
    the down projection (D, I). Under expert parallelism each (E, ...) parameter is sharded on its expert dimension
    as the base weights are (parallel/expert_parallel.py): `sharding.local` gives this rank's experts."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, args: LoraArgs):
        super().__init__()
        self.scale, rank = args.expert_scale, args.experts_rank  # lora.expert_rank, where set
        self.gate_up_A = nn.Parameter(torch.empty(num_experts, rank, dim))
        self.gate_up_B = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, rank))
        self.down_A = nn.Parameter(torch.empty(num_experts, rank, hidden_dim))
        self.down_B = nn.Parameter(torch.empty(num_experts, dim, rank))
        self.dropout = nn.Dropout(args.dropout) if args.dropout else nn.Identity()

    def pairs(self, which: str, sharding, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (A, B) of `which` ("gate_up" or "down") in `dtype`."""
        return tuple(sharding.local(getattr(self, f"{which}_{m}")).to(dtype) for m in ("A", "B"))

    def grouped(self, x: torch.Tensor, which: str, offsets: torch.Tensor, sharding) -> torch.Tensor:
        """x (M, in) sorted by expert, `offsets` each expert's end row -> (M, out): two grouped GEMMs."""
        a, b = self.pairs(which, sharding, x.dtype)
        low = torch._grouped_mm(self.dropout(x), a.transpose(-2, -1), offs=offsets) * self.scale
        return torch._grouped_mm(low, b.transpose(-2, -1), offs=offsets)

    def one(self, x: torch.Tensor, which: str, expert: int, sharding) -> torch.Tensor:
        """Expert `expert`'s (a local index) update of its rows x (the reference path)."""
        a, b = self.pairs(which, sharding, x.dtype)
        return F.linear(F.linear(self.dropout(x), a[expert]) * self.scale, b[expert])


def _targets_of(model: nn.Module, args: LoraArgs) -> list[tuple[str, nn.Module, str]]:
    """(module name, module, target) of every module `args` adapts."""
    chosen = set(args.targets)
    found = []
    for name, module in model.named_modules():
        if name.startswith("mtp.") and not args.mtp:
            continue
        parts = name.split(".")
        leaf, parent = parts[-1], parts[-2] if len(parts) > 1 else ""
        if isinstance(module, RoutedExperts):
            target = "experts"
        elif isinstance(module, TopKRouter):
            target = "router"
        elif isinstance(module, Linear) and parent == "shared_expert":
            target = "shared_expert"
        elif isinstance(module, Linear) and leaf in DENSE_TARGETS:
            target = leaf
        else:
            continue
        if target in chosen:
            found.append((name, module, target))
    return found


def add_adapters(model: nn.Module, args: LoraArgs) -> int:
    """Freeze every parameter of `model` and give each targeted module its adapter (on any device, meta too: their
    values come with init_weights). Returns how many modules were adapted."""
    model.requires_grad_(False)
    targets = _targets_of(model, args)
    for _, module, target in targets:
        weight = module.gate_up_proj if target == "experts" else module.weight
        with torch.device(weight.device):
            if target == "experts":
                num_experts, two_hidden, dim = weight.shape
                module.adapter = ExpertLowRank(num_experts, dim, two_hidden // 2, args)
            else:
                module.adapter = LowRank(weight.shape[1], weight.shape[0], args)
    return len(targets)


def adapted_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module that carries an adapter."""
    return [(name, module) for name, module in model.named_modules() if getattr(module, "adapter", None) is not None]


def hold_frozen_in(model: nn.Module, dtype: torch.dtype | None, fp8: frozenset[str] = frozenset()) -> int:
    """Hold every frozen weight of two or more dimensions in `dtype` (the compute dtype: a frozen base needs no fp32
    master copy; vectors, the fp32 contract's among them, keep theirs; None: as they are), and those whose
    state-dict keys are in `fp8` (the quantized weights of an FP8 release base) as float8 with their block scales
    (fp8_hold.py). Shared parameters (tied embeddings) stay shared. Returns how many parameters changed."""
    converted: dict[nn.Parameter, nn.Parameter] = {}
    for prefix, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            key = canonical_name(f"{prefix}.{name}" if prefix else name)
            if param in converted:
                setattr(module, name, converted[param])
            elif not param.requires_grad and key in fp8:
                hold_fp8(module, name)
                converted[param] = getattr(module, name)
            elif not param.requires_grad and param.ndim >= 2 and dtype is not None and param.dtype != dtype:
                converted[param] = nn.Parameter(param.detach().to(dtype), requires_grad=False)
                setattr(module, name, converted[param])
    return len(converted)


def active_adapter_params(model: nn.Module, top_k: int, mtp: bool) -> int:
    """Adapter parameters one token touches (its top-k experts' of the routed experts' adapters; the MTP layers'
    only with `mtp`, where they run): the adapters' share of a LoRA run's FLOPs (harness/metrics.py)."""
    total = 0
    for name, module in adapted_modules(model):
        if canonical_name(name).startswith("mtp.") and not mtp:
            continue
        params = sum(p.numel() for p in module.adapter.parameters())
        total += params * top_k // module.num_experts if isinstance(module.adapter, ExpertLowRank) else params
    return total


def adapter_shapes(args: Qwen35MoeArgs, lora: LoraArgs) -> dict[str, tuple[int, ...]]:
    """Every adapter key (with its shape) of a model of `args` with the adapters `lora` (built on the meta device)."""
    with torch.device("meta"):
        model = Qwen35MoeModel(args)
        add_adapters(model, lora)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if is_adapter_key(k)}
