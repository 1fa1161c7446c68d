"""Qwen3.5-MoE model arguments, and their conversion from / to a transformers config.json.

Field names follow the Hugging Face config (`hidden_size`, `linear_num_value_heads`, ...) so that a
config.json maps onto them one to one and users read the same names in both places.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")  # multimodal release, text-only export
# Sizes that must be at least 1 (a config.json's 0 or negative one would fail deep inside torch)
_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
          "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
          "linear_conv_kernel_dim", "num_experts", "moe_intermediate_size", "shared_expert_intermediate_size")


@dataclass
class Qwen35MoeArgs:
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    # Every `full_attention_interval`-th layer is full attention, the others Gated DeltaNet;
    # an explicit `layer_types` list (as in config.json) overrides the interval.
    full_attention_interval: int = 4
    layer_types: list[str] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    # Gated full attention: q_proj yields query and output gate; per-head q/k RMSNorm; partial RoPE.
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    attention_bias: bool = False
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    # M-RoPE sections (temporal, height, width). For text the three position axes are equal, which
    # makes M-RoPE exactly 1-D RoPE; kept only to write them back on export.
    mrope_section: list[int] = field(default_factory=lambda: [11, 11, 10])
    mrope_interleaved: bool = True
    max_position_embeddings: int = 262144

    # Gated DeltaNet (linear attention).
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4

    # Sparse MoE: softmax router, top-k renormalised, plus one sigmoid-gated shared expert.
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    router_aux_loss_coef: float = 0.001

    # Multi-token prediction (mtp.py): this many MTP layers after the main stack, predicting x_{t+2}; 0: none.
    # The released checkpoints have one, sharing the main embedding (dedicated embeddings are not supported).
    mtp_num_hidden_layers: int = 0
    mtp_use_dedicated_embeddings: bool = False

    # Fields of the official config.json that describe what this model always does (an output-gated attention;
    # the SSM state in fp32) or concern inference only: kept to be written back on export as they were read.
    attn_output_gate: bool = True
    mamba_ssm_dtype: str = "float32"
    use_cache: bool = True
    output_router_logits: bool = False

    # Written to config.json on export; not used by the model.
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 248044
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.layer_types is None and self.full_attention_interval >= 1:  # below 1: validate names it
            self.layer_types = [
                FULL_ATTENTION if (i + 1) % self.full_attention_interval == 0 else LINEAR_ATTENTION
                for i in range(self.num_hidden_layers)
            ]
        self.validate()

    def validate(self) -> None:
        problems = [f"{name} must be >= 1, got {getattr(self, name)}" for name in _SIZES if getattr(self, name) < 1]
        if self.layer_types is None:
            problems.append(f"full_attention_interval must be >= 1, got {self.full_attention_interval}")
        problems += self._value_problems()
        if problems:  # before the checks below divide by them
            raise ValueError("invalid Qwen3.5-MoE args: " + "; ".join(problems))
        if len(self.layer_types) != self.num_hidden_layers:
            problems.append(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        unknown = sorted(set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
        if unknown:
            problems.append(f"unknown layer types {unknown}")
        if self.num_attention_heads % self.num_key_value_heads:
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            problems.append("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            problems.append("num_experts_per_tok must be in [1, num_experts]")
        if not self.attn_output_gate:
            problems.append("attn_output_gate false is not supported (the attention layers always gate their output)")
        if self.mtp_num_hidden_layers < 0:
            problems.append(f"mtp_num_hidden_layers must be >= 0, got {self.mtp_num_hidden_layers}")
        if self.mtp_use_dedicated_embeddings:
            problems.append("mtp_use_dedicated_embeddings true is not supported (the MTP layer shares embed_tokens)")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            problems.append(f"rotary dim {self.rotary_dim} (head_dim * partial_rotary_factor) must be even and <= head_dim")
        if problems:
            raise ValueError("invalid Qwen3.5-MoE args: " + "; ".join(problems))

    def _value_problems(self) -> list[str]:
        """The non-size numbers outside what the model can use (nan and inf included: no comparison admits them),
        each a line: a config.json's `rms_norm_eps: NaN` would otherwise train to a NaN loss blamed on the lr."""
        ranges = {
            "rms_norm_eps": (0 < self.rms_norm_eps < 1, "in (0, 1)"),
            "rope_theta": (0 < self.rope_theta < math.inf, "positive and finite"),
            "partial_rotary_factor": (0 < self.partial_rotary_factor <= 1, "in (0, 1]"),
            "initializer_range": (0 <= self.initializer_range < math.inf, ">= 0 and finite"),
            "router_aux_loss_coef": (0 <= self.router_aux_loss_coef < math.inf, ">= 0 and finite"),
            "max_position_embeddings": (self.max_position_embeddings >= 1, ">= 1"),
            "mrope_section": (all(v >= 0 for v in self.mrope_section), "non-negative"),
        }
        return [f"{name} must be {what}, got {getattr(self, name)}" for name, (ok, what) in ranges.items() if not ok]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def num_layers_of(self, layer_type: str) -> int:
        return sum(t == layer_type for t in self.layer_types)

    # ---- transformers config.json ----

    @classmethod
    def from_hf_config(cls, config: dict[str, Any] | str | Path) -> "Qwen35MoeArgs":
        """Read a transformers Qwen3.5-MoE config: a dict, a config.json path or a folder holding one.

        Accepts text-only (`qwen3_5_moe_text`) and multimodal (`qwen3_5_moe`, text fields nested under
        `text_config`) configs, with rope settings either in `rope_parameters` (transformers 5) or flat.
        """
        if not isinstance(config, dict):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise FileNotFoundError(f"no transformers config.json at {path}")
            config = json.loads(path.read_text())
        if not isinstance(config, dict):
            raise ValueError(f"a config.json holds a JSON object, not a JSON {type(config).__name__}")
        model_type = config.get("model_type")
        if model_type is not None and model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not a Qwen3.5-MoE model (one of {', '.join(MODEL_TYPES)})")
        text = config.get("text_config") or config
        if not isinstance(text, dict):
            raise ValueError(f"text_config is a JSON {type(text).__name__}, not an object")
        text = dict(text)
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported (only default / M-RoPE)")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in text.items() if k in names}
        for key in ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"):
            if key in rope:
                kwargs[key] = rope[key]
        if "tie_word_embeddings" in config and "tie_word_embeddings" not in text:
            kwargs["tie_word_embeddings"] = config["tie_word_embeddings"]
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        wrong = [f"{k} = {v!r} is not {types[k]}" for k, v in kwargs.items() if not _fits(v, types[k])]
        if wrong:  # before any arithmetic on them: a string or a list where a size belongs
            raise ValueError("invalid Qwen3.5-MoE config: " + "; ".join(wrong))
        return cls(**kwargs)

    def to_hf_config(self, dtype: str = "bfloat16") -> dict[str, Any]:
        """The text-only CausalLM config.json that transformers' Qwen3_5MoeForCausalLM loads."""
        cfg = {
            "architectures": ["Qwen3_5MoeForCausalLM"],
            "model_type": "qwen3_5_moe_text",
            "dtype": dtype,
            "hidden_act": "silu",
            "attention_dropout": 0.0,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "mrope_section": list(self.mrope_section),
                "mrope_interleaved": self.mrope_interleaved,
            },
        }
        # The official config.json holds partial_rotary_factor both in rope_parameters and at the top level.
        skip = {"rope_theta", "mrope_section", "mrope_interleaved"}
        for f in dataclasses.fields(self):
            if f.name not in skip:
                cfg[f.name] = getattr(self, f.name)
        return cfg


def _fits(value: Any, annotation: str) -> bool:
    """Whether a config.json value fits a field's annotation (as written in this file: `int`, `float`, `bool`,
    `str`, `None`, `list[...]` and unions of them); an int fits `float`, a bool fits only `bool`."""
    for part in (p.strip() for p in annotation.split("|")):
        if part == "None" and value is None or part == "bool" and isinstance(value, bool):
            return True
        if isinstance(value, bool):
            continue
        if part == "int" and isinstance(value, int) or part == "float" and isinstance(value, (int, float)):
            return True
        if part == "str" and isinstance(value, str):
            return True
        if part.startswith("list[") and isinstance(value, list) and all(_fits(v, part[5:-1]) for v in value):
            return True
    return False
