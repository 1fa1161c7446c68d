"""Conversion between native state dicts and Hugging Face Qwen3.5-MoE checkpoints.

Native keys mirror the HF names without the `model.` prefix, so most conversions are renames. Every
conversion, in order:

HF -> native (`from_hf`), accepting both the text-only and the multimodal layout:
  1. prefix: `model.language_model.` (multimodal) or `model.` (text-only) is removed; `lm_head.weight`
     stays as is. Vision tower (`model.visual.*`) and multi-token-prediction (`mtp.*`) weights are
     skipped, with one log line saying how many.
  2. experts: per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` ((I, D), (I, D), (D, I)) are fused
     into `mlp.experts.gate_up_proj` (E, 2I, D) = cat(gate, up) per expert and `mlp.experts.down_proj`
     (E, D, I). Already fused checkpoints pass through.
  3. fp32 SSM gate: `linear_attn.A_log` / `linear_attn.dt_bias` are routed into the
     `linear_attn._fp32_params.` holder and upcast to fp32 when stored in lower precision.
  4. tied embeddings: when the model ties them and `lm_head.weight` is absent, it is the embedding.
  5. validation against the model's own keys and shapes: any missing, unexpected or mis-shaped key
     raises one ValueError that names them.

native -> HF (`to_hf`), always the text-only CausalLM layout with fused experts:
  1. `_fp32_params.` holder stripped; A_log / dt_bias emitted in fp32.
  2. `model.` prefix added to everything but `lm_head.weight` (dropped when embeddings are tied).
  Dtypes are otherwise kept; `hf_export_dtype` gives the dtype each key is written in on export.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from .args import Qwen35MoeArgs
from .gated_delta_net_fp32 import (
    is_gated_delta_net_fp32_param_key,
    route_fp32_holder_key,
    strip_fp32_holder_key,
    upcast_gated_delta_net_fp32_state_tensor,
)

logger = logging.getLogger(__name__)

_PER_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
_LM_HEAD = "lm_head.weight"


def hf_export_dtype(hf_key: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype an HF key is written in: fp32 for the SSM gate and GDN output norm (as in the official
    release), `dtype` for everything else."""
    if is_gated_delta_net_fp32_param_key(hf_key) or hf_key.endswith(".linear_attn.norm.weight"):
        return torch.float32
    return dtype


def expected_native_shapes(args: Qwen35MoeArgs) -> dict[str, tuple[int, ...]]:
    """Every native state-dict key with its shape, read off a meta-device model."""
    from .model import Qwen35MoeModel

    with torch.device("meta"):
        model = Qwen35MoeModel(args)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _short(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:8]) + (f" ... ({len(keys)} in all)" if len(keys) > 8 else "")


class Qwen35MoeStateDictAdapter:
    """torchtitan's StateDictAdapter protocol (`to_hf` / `from_hf`) for Qwen3.5-MoE."""

    def __init__(self, args: Qwen35MoeArgs):
        self.args = args
        self._expected: dict[str, tuple[int, ...]] | None = None

    @property
    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        if self._expected is None:
            self._expected = expected_native_shapes(self.args)
        return self._expected

    # ---- native -> HF ----

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        hf = {}
        for key, value in state_dict.items():
            if key == _LM_HEAD:
                if not self.args.tie_word_embeddings:
                    hf[key] = value
                continue
            hf_key = "model." + strip_fp32_holder_key(key)
            if is_gated_delta_net_fp32_param_key(hf_key) and value.dtype != torch.float32:
                value = value.to(torch.float32)
            hf[hf_key] = value
        return hf

    # ---- HF -> native ----

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        renamed, skipped = {}, 0
        multimodal = any(k.startswith("model.language_model.") for k in hf_state_dict)
        prefix = "model.language_model." if multimodal else "model."
        for key, value in hf_state_dict.items():
            if key.startswith(_SKIPPED_PREFIXES):
                skipped += 1
                continue
            if key == _LM_HEAD:
                renamed[key] = value
            elif key.startswith(prefix):
                renamed[key[len(prefix) :]] = value
            else:
                renamed[key] = value  # reported as unexpected by validation below
        if skipped:
            logger.info("skipped %d vision / multi-token-prediction tensors not used by the text model", skipped)

        native = self._fuse_per_expert(renamed)
        native = {
            route_fp32_holder_key(k): upcast_gated_delta_net_fp32_state_tensor(k, v) for k, v in native.items()
        }
        if self.args.tie_word_embeddings and _LM_HEAD not in native and "embed_tokens.weight" in native:
            native[_LM_HEAD] = native["embed_tokens.weight"]
        self._validate(native)
        return native

    def _fuse_per_expert(self, state: dict[str, Any]) -> dict[str, Any]:
        fused, per_expert = {}, {}
        for key, value in state.items():
            m = _PER_EXPERT.match(key)
            if m:
                per_expert.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = value
            else:
                fused[key] = value
        num_experts = self.args.num_experts
        for base, parts in per_expert.items():
            missing = [
                f"{base}.{e}.{p}.weight"
                for e in range(num_experts)
                for p in ("gate_proj", "up_proj", "down_proj")
                if (e, p) not in parts
            ]
            if missing:
                raise ValueError(f"checkpoint lacks per-expert keys {_short(missing)}; expected {num_experts} experts")
            extra = sorted({e for e, _ in parts if e >= num_experts})
            if extra:
                raise ValueError(f"checkpoint has experts {extra} under {base}, the model has {num_experts}")
            fused[f"{base}.gate_up_proj"] = torch.stack(
                [torch.cat((parts[(e, "gate_proj")], parts[(e, "up_proj")]), dim=0) for e in range(num_experts)]
            )
            fused[f"{base}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(num_experts)])
        return fused

    def _validate(self, native: dict[str, Any]) -> None:
        expected = self.expected_shapes
        missing = expected.keys() - native.keys()
        unexpected = native.keys() - expected.keys()
        misshaped = [
            f"{k} {tuple(native[k].shape)} (expected {expected[k]})"
            for k in expected.keys() & native.keys()
            if tuple(native[k].shape) != expected[k]
        ]
        problems = []
        if missing:
            problems.append(f"missing keys: {_short(missing)}")
        if unexpected:
            problems.append(f"unexpected keys: {_short(unexpected)}")
        if misshaped:
            problems.append(f"wrong shapes: {_short(misshaped)}")
        if problems:
            raise ValueError(
                "checkpoint does not match the Qwen3.5-MoE model "
                f"({self.args.num_hidden_layers} layers, hidden {self.args.hidden_size}, "
                f"{self.args.num_experts} experts) - " + "; ".join(problems) + ". Was it saved by another model shape?"
            )
