"""Conversion between native state dicts and Hugging Face Qwen3.5-MoE checkpoints.

Native keys mirror the HF names without the `model.` prefix, so most conversions are renames. Every
conversion, in order:

HF -> native (`from_hf`), accepting both the text-only and the multimodal layout:
  1. prefix: `model.language_model.` (multimodal) or `model.` (text-only) is removed; `lm_head.weight`
     stays as is. Multi-token-prediction weights `mtp.*` (top level in both layouts, as in the releases) keep
     their names: the native MTP module is `mtp` (mtp.py); a model without one (mtp_num_hidden_layers 0) skips
     them, as it skips the vision tower (`model.visual.*`), with one log line saying how many.
  2. experts: per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight` ((I, D), (I, D), (D, I)), in the main
     layers and in `mtp.layers.*` alike, are fused
     into `mlp.experts.gate_up_proj` (E, 2I, D) = cat(gate, up) per expert and `mlp.experts.down_proj`
     (E, D, I). Already fused checkpoints pass through.
  3. fp32 SSM gate: `linear_attn.A_log` / `linear_attn.dt_bias` are routed into the
     `linear_attn._fp32_params.` holder and upcast to fp32 when stored in lower precision.
  4. tied embeddings: when the model ties them and `lm_head.weight` is absent, it is the embedding.
  5. validation against the model's own keys and shapes: any missing, unexpected or mis-shaped key
     raises one ValueError that names them.
  Steps 1-4 on key names alone are `plan_from_hf` (native key -> the HF keys it is built from); `combine` builds
  one native tensor from those. A loader can so read and convert one tensor at a time; `from_hf` is both on
  a whole in-memory state dict.

native -> HF (`to_hf`), always the text-only CausalLM layout, the release's names otherwise:
  1. `_fp32_params.` holder stripped; A_log / dt_bias emitted in fp32.
  2. `model.` prefix added to everything but `lm_head.weight` (dropped when embeddings are tied) and `mtp.*`
     (top level, its official place).
  3. experts: the main layers' stay fused (`mlp.experts.gate_up_proj` (E, 2I, D), `down_proj` (E, D, I)), as the
     release and transformers' Qwen3_5MoeForCausalLM hold them; the MTP layers' are split per expert, as the release
     stores them: `mtp.layers.N.mlp.experts.{e}.gate_proj.weight` = gate_up_proj[e, :I], `up_proj` = [e, I:]
     ((I, D) each), `down_proj` = down_proj[e] ((D, I)).
  Dtypes are otherwise kept; `hf_export_dtype` gives the dtype each key is written in on export (`mtp.*` as the
  main layers' tensors of the same kind). One native tensor at a time: `to_hf_shapes` names the HF keys (and
  their shapes) it is exported as, `to_hf_tensor` cuts one of them out of it; `to_hf_key` is the renaming of a
  one-to-one key.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from .args import Qwen35MoeArgs
from .fp32_contract import (
    is_gated_delta_net_fp32_param_key,
    route_fp32_holder_key,
    strip_fp32_holder_key,
    upcast_gated_delta_net_fp32_state_tensor,
)

logger = logging.getLogger(__name__)

_PER_EXPERT = re.compile(r"^((?:mtp\.)?layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_MTP_FUSED_EXPERTS = re.compile(r"^(mtp\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_SKIPPED_PREFIXES = ("model.visual.", "visual.")
_MTP = "mtp."
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
            for hf_key in self.to_hf_shapes(key, tuple(value.shape)):
                hf[hf_key] = self.to_hf_tensor(hf_key, value)
        return hf

    def to_hf_shapes(self, key: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The HF keys a native tensor of this shape is exported as, with their shapes: one for most, 2E (gate and
        up per expert) or E (down per expert) for an MTP layer's fused experts, none for a tied lm_head."""
        m = _MTP_FUSED_EXPERTS.match(key)
        if m is None:
            hf_key = self.to_hf_key(key)
            return {} if hf_key is None else {hf_key: tuple(shape)}
        base, fused = m.groups()
        experts, rows, cols = shape
        if fused == "gate_up_proj":  # (E, 2I, D)
            return {f"{base}.{e}.{part}.weight": (rows // 2, cols)
                    for e in range(experts) for part in ("gate_proj", "up_proj")}
        return {f"{base}.{e}.down_proj.weight": (rows, cols) for e in range(experts)}  # (E, D, I)

    def to_hf_tensor(self, hf_key: str, native: Any) -> Any:
        """The HF tensor `hf_key` out of the native tensor it is exported from (`to_hf_shapes`): one expert's slice
        (a view) of an MTP layer's fused experts, the SSM gate in fp32, otherwise the tensor itself."""
        m = _PER_EXPERT.match(hf_key)
        if m is not None:
            expert, proj = int(m.group(2)), m.group(3)
            if proj == "down_proj":
                return native[expert]
            half = native.shape[1] // 2
            return native[expert, :half] if proj == "gate_proj" else native[expert, half:]
        if is_gated_delta_net_fp32_param_key(hf_key) and native.dtype != torch.float32:
            return native.to(torch.float32)
        return native

    def to_hf_key(self, key: str) -> str | None:
        """The HF key a one-to-one native key is exported under (None: a tied lm_head, not written); an MTP layer's
        fused experts are exported under several (`to_hf_shapes`)."""
        if key == _LM_HEAD:
            return None if self.args.tie_word_embeddings else key
        if key.startswith(_MTP):
            return key
        return "model." + strip_fp32_holder_key(key)

    # ---- HF -> native ----

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        plan = self.plan_from_hf(hf_state_dict)
        native = {key: self.combine(key, [hf_state_dict[h] for h in sources]) for key, sources in plan.items()}
        self._validate(native)
        return native

    def plan_from_hf(self, hf_keys) -> dict[str, list[str]]:
        """For every native key, the HF keys it is built from, in order (one, or 3 * E per-expert keys for a
        fused expert pair); from the checkpoint's key names alone, so a loader can read one tensor at a time.
        Missing or unexpected keys raise one ValueError naming them."""
        hf_keys = list(hf_keys)
        multimodal = any(k.startswith("model.language_model.") for k in hf_keys)
        prefix = "model.language_model." if multimodal else "model."
        renamed, skipped = {}, 0  # native-style name (before fusing and routing) -> HF key
        has_mtp = self.args.mtp_num_hidden_layers > 0
        for key in hf_keys:
            if key.startswith(_SKIPPED_PREFIXES) or (key.startswith((_MTP, "model.mtp.")) and not has_mtp):
                skipped += 1
            elif key == _LM_HEAD or key.startswith(_MTP) or not key.startswith(prefix):
                renamed[key] = key  # lm_head, or a stray key that validation reports as unexpected
            else:
                renamed[key[len(prefix) :]] = key
        if skipped:
            logger.info("skipped %d vision / multi-token-prediction tensors not used by the text model", skipped)

        plan = {}
        per_expert = {}
        for name, hf_key in renamed.items():
            m = _PER_EXPERT.match(name)
            if m:
                per_expert.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = hf_key
            else:
                plan[route_fp32_holder_key(name)] = [hf_key]
        for base, parts in per_expert.items():
            plan.update(self._fused_expert_sources(base, parts))
        if self.args.tie_word_embeddings and _LM_HEAD not in plan and "embed_tokens.weight" in plan:
            plan[_LM_HEAD] = plan["embed_tokens.weight"]
        self._validate_keys(plan.keys())
        return plan

    def _fused_expert_sources(self, base: str, parts: dict[tuple[int, str], str]) -> dict[str, list[str]]:
        num_experts = self.args.num_experts
        missing = [f"{base}.{e}.{p}.weight" for e in range(num_experts) for p in ("gate_proj", "up_proj", "down_proj")
                   if (e, p) not in parts]
        if missing:
            raise ValueError(f"checkpoint lacks per-expert keys {_short(missing)}; expected {num_experts} experts")
        extra = sorted({e for e, _ in parts if e >= num_experts})
        if extra:
            raise ValueError(f"checkpoint has experts {extra} under {base}, the model has {num_experts}")
        experts = range(num_experts)
        return {f"{base}.gate_up_proj": [parts[(e, p)] for e in experts for p in ("gate_proj", "up_proj")],
                f"{base}.down_proj": [parts[(e, "down_proj")] for e in experts]}

    def combine(self, key: str, tensors: list[Any]) -> Any:
        """The native tensor `key` from the HF tensors `plan_from_hf` named for it: per-expert weights fused
        ((E, 2I, D) = cat(gate, up) per expert; (E, D, I)), the SSM gate upcast to fp32, otherwise as is."""
        if len(tensors) > 1 and key.endswith("experts.gate_up_proj"):
            # fused in place: beside the parts only the result (a stack of per-expert cats held a third copy)
            rows = tensors[0].shape[0]
            fused = tensors[0].new_empty((len(tensors) // 2, 2 * rows, *tensors[0].shape[1:]))
            for e in range(len(tensors) // 2):
                fused[e, :rows].copy_(tensors[2 * e])
                fused[e, rows:].copy_(tensors[2 * e + 1])
            return fused
        if len(tensors) > 1:  # experts.down_proj
            return torch.stack(tensors)
        return upcast_gated_delta_net_fp32_state_tensor(key, tensors[0])

    def _validate_keys(self, keys) -> None:
        expected = self.expected_shapes
        missing, unexpected = expected.keys() - set(keys), set(keys) - expected.keys()
        problems = [f"missing keys: {_short(missing)}"] if missing else []
        if missing and all(k.startswith(_MTP) for k in missing):
            problems.append("the checkpoint has no multi-token-prediction layer: load it with mtp_num_hidden_layers 0 "
                            "(the trainer's model.mtp_num_hidden_layers)")
        problems += [f"unexpected keys: {_short(unexpected)}"] if unexpected else []
        self._raise(problems)

    def validate_shapes(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """ValueError naming every native key whose shape is not the model's."""
        expected = self.expected_shapes
        misshaped = [f"{k} {tuple(s)} (expected {expected[k]})" for k, s in shapes.items() if tuple(s) != expected[k]]
        self._raise([f"wrong shapes: {_short(misshaped)}"] if misshaped else [])

    def _validate(self, native: dict[str, Any]) -> None:
        self._validate_keys(native.keys())
        self.validate_shapes({k: tuple(v.shape) for k, v in native.items()})

    def _raise(self, problems: list[str]) -> None:
        if problems:
            raise ValueError(
                "checkpoint does not match the Qwen3.5-MoE model "
                f"({self.args.num_hidden_layers} layers, hidden {self.args.hidden_size}, "
                f"{self.args.num_experts} experts) - " + "; ".join(problems) + ". Was it saved by another model shape?"
            )
