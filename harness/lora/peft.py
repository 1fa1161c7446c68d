"""A LoRA run's adapters as a PEFT adapter folder: adapter_config.json and adapter_model.safetensors, which
`peft.PeftModel.from_pretrained(base, folder)` loads onto transformers' Qwen3_5MoeForCausalLM holding the base the
adapters were trained on (the text-only layout our exports write: `model.layers.*`). Written beside the merged export
(harness/run_outputs.py `adapter_folder`), by the end of a LoRA run and by the offline converter (harness/lora/run.py).

What it holds, per native adapter (lora.py), under PEFT's saved names (`base_model.model.` + the module's name in
transformers' model + `.lora_A.weight` / `.lora_B.weight`; our module names are transformers' without `model.`):
  dense projections (attention q/k/v/o_proj, Gated DeltaNet in_proj_* / out_proj, shared expert gate/up/down_proj,
  shared_expert_gate: nn.Linear in transformers)   `target_modules`, A (rank, in) and B (out, rank) as they are.
  router (`mlp.gate`: a module holding `weight`, no nn.Linear in transformers)   `target_parameters` "mlp.gate.weight"
    (PEFT's ParamWrapper), A and B as they are.
  routed experts (`mlp.experts`: the fused `gate_up_proj` (E, 2I, D) and `down_proj` (E, D, I) parameters)
    `target_parameters` "mlp.experts.gate_up_proj" and "mlp.experts.down_proj". PEFT's ParamWrapper on a 3-D
    parameter holds one factor pair for all experts: lora_A.weight (E * rank, in) whose rows e*rank .. e*rank+rank-1
    are expert e's A, and lora_B.weight (out, rank * E) whose column j*E + e is column j of expert e's B; its update
    of expert e is scale * B_e A_e (scale alpha / rank), ours exactly. Both parameters of one module are targeted, so
    PEFT nests two wrappers: the one on gate_up_proj (transformers registers it first) inside, its factors under
    `mlp.experts.base_layer.`, down_proj's under `mlp.experts.`. Read in PEFT 0.19 to 0.21
    (tuners/lora/layer.py, ParamWrapper; 0.19 is the first to take transformers 5's (E, out, in) expert layout).
  With `lora.expert_rank` the experts' factors have their own rank, which the config states as `rank_pattern` for
  those two parameters: PEFT builds them at that rank and scales them by alpha over it, as they trained.
  MTP layers (`mtp.*`): left out, with a log line: transformers' model has no MTP layer (it drops `mtp.*` on
    load); the merged export holds them.
PEFT's ParamWrapper refuses lora_dropout other than 0, and PEFT has one lora_dropout for the whole adapter: when the
router or the experts are in it, the config says 0 (dropout acts in training only: the adapter's outputs are the
same), with a log line. The factors are written in fp32, as they train.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from models.qwen35_moe.lora_targets import ADAPTER, LoraArgs

from ..checkpoint.hf_weights import ExportUnit, write_export_folder

logger = logging.getLogger(__name__)

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PREFIX = "base_model.model."  # PeftModelForCausalLM's base_model (LoraModel) .model (the transformers model)
_ROUTER = ".mlp.gate"
_EXPERT_PARAMETERS = {"gate_up": "mlp.experts.gate_up_proj", "down": "mlp.experts.down_proj"}
EXPERT_PARAMETERS = set(_EXPERT_PARAMETERS.values())
_INNER = {"gate_up": ".base_layer", "down": ""}  # the nesting of the two ParamWrappers (module docstring)


@dataclass
class PeftLayout:
    """The PEFT names of a set of native adapter keys: what is written and what is left out."""
    native_of: dict[str, str] = field(default_factory=dict)  # PEFT key -> native adapter key
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # PEFT key -> its shape
    target_modules: set[str] = field(default_factory=set)
    target_parameters: set[str] = field(default_factory=set)
    left_out: list[str] = field(default_factory=list)  # native keys of the MTP layers' adapters


def peft_layout(shapes: dict[str, tuple[int, ...]]) -> PeftLayout:
    """PEFT's keys and targets for native adapter keys (with their shapes)."""
    layout = PeftLayout()
    for key, shape in sorted(shapes.items()):
        module, _, name = key.rpartition(ADAPTER)
        if module.startswith("mtp."):
            layout.left_out.append(key)
            continue
        hf_module = "model." + module
        which, factor = name.rsplit("_", 1)  # lora_A -> ("lora", "A"), gate_up_B -> ("gate_up", "B")
        if which in _EXPERT_PARAMETERS:
            layout.target_parameters.add(_EXPERT_PARAMETERS[which])
            hf_module += _INNER[which]
            experts, rows, cols = shape
            shape = (experts * rows, cols) if factor == "A" else (rows, cols * experts)
        elif module.endswith(_ROUTER):
            layout.target_parameters.add(_ROUTER[1:] + ".weight")
        else:
            parts = module.split(".")
            layout.target_modules.add(".".join(parts[-2:]) if parts[-2] == "shared_expert" else parts[-1])
        peft_key = f"{_PREFIX}{hf_module}.lora_{factor}.weight"
        layout.native_of[peft_key] = key
        layout.shapes[peft_key] = shape
    return layout


def to_peft(native_key: str, tensor: torch.Tensor) -> torch.Tensor:
    """A native adapter factor as PEFT holds it: the experts' (E, rank, in) A as (E * rank, in), expert-major; their
    (E, out, rank) B as (out, rank * E), column j*E + e from expert e; dense factors as they are."""
    if tensor.ndim != 3:
        return tensor
    experts, rows, cols = tensor.shape
    if native_key.endswith("_A"):
        return tensor.reshape(experts * rows, cols)
    return tensor.permute(1, 2, 0).reshape(rows, cols * experts)


def peft_config(lora: LoraArgs, layout: PeftLayout, base: str | None) -> dict:
    """adapter_config.json: LoraConfig's fields that describe these adapters (the rest at PEFT's defaults)."""
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base or None,
        "r": lora.rank, "lora_alpha": alpha, "lora_dropout": 0.0 if layout.target_parameters else lora.dropout,
        "target_modules": sorted(layout.target_modules) or None,
        "target_parameters": sorted(layout.target_parameters) or None,
        "bias": "none", "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        # the routed experts' own rank (lora.expert_rank): PEFT then scales them by alpha over it, as they trained
        "rank_pattern": {name: lora.experts_rank for name in sorted(layout.target_parameters & EXPERT_PARAMETERS)
                         if lora.experts_rank != lora.rank},
        "alpha_pattern": {}, "revision": None,
    }


def write_peft_adapter(folder: str | Path, lora: LoraArgs, shapes: dict[str, tuple[int, ...]],
                       read: Callable[[str], torch.Tensor], base: str | None = None,
                       source: str | Path | None = None, unit: ExportUnit | None = None) -> list[str]:
    """Write the PEFT adapter folder of the native adapters `shapes` (key -> shape), each read whole by `read` (a
    collective under FSDP: every rank calls this alike, rank 0 writes), trained with `lora` on the base `base` (its
    HF folder, as the run named it; None: drawn from the seed). The folder rules are the merged export's
    (write_export_folder, `source` the checkpoint it is made from; with `unit`, published with the merged model).
    Returns the lines saying what PEFT's folder leaves out or states otherwise (also logged); no folder is written
    when it would hold nothing."""
    layout = peft_layout(shapes)
    notes = []
    if layout.left_out:
        notes.append(f"PEFT adapter: the {len(layout.left_out)} adapter tensors of the MTP layers (mtp.*) are left out: "
                     "transformers' Qwen3_5MoeForCausalLM has no MTP layer; the merged export holds them merged")
    if layout.target_parameters and lora.dropout:
        notes.append(f"PEFT adapter: lora_dropout written as 0 (trained with {lora.dropout:g}): PEFT's ParamWrapper, "
                     "which carries the router and the routed experts, refuses dropout; it acts in training only")
    if not layout.shapes:
        notes.append(f"PEFT adapter: no adapter outside the MTP layers, nothing for PEFT to load: {folder} not written")
    for note in notes:
        logger.info("%s", note)
    if not layout.shapes:
        return notes
    specs = {key: (torch.float32, shape) for key, shape in layout.shapes.items()}
    config = peft_config(lora, layout, base)

    def fetch(keys: list[str], keep: bool):
        for key in keys:
            native = layout.native_of[key]
            tensor = read(native)  # on every rank: it may gather
            yield key, to_peft(native, tensor).detach().to("cpu", torch.float32) if keep else None

    def finish(tmp: Path) -> None:
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")

    write_export_folder(folder, {WEIGHTS_NAME: specs}, fetch, finish, source, unit)
    return notes
