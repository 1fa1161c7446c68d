"""What LoRA can adapt in this model and how its adapters are named: plain facts, no torch (the config schema reads
them to check `lora.targets` before anything heavy is imported; models/qwen35_moe/lora.py builds the adapters).

Targets name modules by their last name, as PEFT's `target_modules` does: the gated attention's q/k/v/o_proj, Gated
DeltaNet's in_proj_qkv / in_proj_z / in_proj_a / in_proj_b / out_proj, the shared expert's projections
("shared_expert"), its gate ("shared_expert_gate"), the routed experts ("experts"), the router ("router") and the MTP
layer's input projection ("fc"). The embedding and the lm_head are never adapted (train them fully instead).

An adapter is the `adapter` submodule of the module it adapts, so its parameters' state-dict keys hold ADAPTER:
  `<module>.adapter.lora_A` (rank, in), `<module>.adapter.lora_B` (out, rank) beside `<module>.weight` (out, in);
  `<experts>.adapter.gate_up_A` (E, rank, D), `gate_up_B` (E, 2I, rank) beside `<experts>.gate_up_proj` (E, 2I, D);
  `<experts>.adapter.down_A` (E, rank, I), `down_B` (E, D, rank) beside `<experts>.down_proj` (E, D, I).
"""

from __future__ import annotations

from dataclasses import dataclass

DENSE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b",
                 "out_proj", "shared_expert", "shared_expert_gate", "router", "fc")
TARGETS = (*DENSE_TARGETS, "experts")
# Every projection of the blocks but the routing ones (router and shared-expert gate: a rank-r update of a
# one-row or E-row matrix adds nothing a full update would not, and they steer the experts' load).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b",
                   "out_proj", "shared_expert", "experts")

ADAPTER = ".adapter."  # in the state-dict key of every adapter parameter
# an adapter's A factor -> the base weight it updates, beside the adapter's module
WEIGHT_OF_A = {"lora_A": "weight", "gate_up_A": "gate_up_proj", "down_A": "down_proj"}


def is_adapter_key(key: str) -> bool:
    return ADAPTER in key


EXPERT_FACTORS = ("gate_up_A", "gate_up_B", "down_A", "down_B")  # the routed experts' adapters' parameters


@dataclass(frozen=True)
class LoraArgs:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    mtp: bool = False  # adapters on the MTP layers too (else they stay frozen as loaded)
    expert_rank: int = 0  # the routed experts' adapters' rank (PEFT's rank_pattern); 0: `rank`

    @property
    def scale(self) -> float:
        """s of the dense projections' adapters (alpha / rank)."""
        return self.alpha / self.rank

    @property
    def experts_rank(self) -> int:
        return self.expert_rank or self.rank

    @property
    def expert_scale(self) -> float:
        """s of the routed experts' adapters: alpha over their own rank, as PEFT's rank_pattern gives them."""
        return self.alpha / self.experts_rank

    def scale_of(self, key: str) -> float:
        """The scale of the adapter a state-dict key belongs to (an experts' factor, or a dense one)."""
        return self.expert_scale if key.rpartition(".")[2] in EXPERT_FACTORS else self.scale
