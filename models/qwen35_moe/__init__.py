"""Native Qwen3.5-MoE (hybrid Gated DeltaNet + gated attention + sparse MoE) for training.

Names are imported on first use (PEP 562), so `models.qwen35_moe.args` / `.flavors` (plain Python) load without
torch: the launcher validates a config, flavor included, in a fraction of a second.
"""

import importlib

_HOME = {
    "CausalLMOutput": ".model",
    "Qwen35MoeArgs": ".args",
    "Qwen35MoeModel": ".model",
    "Qwen35MoeStateDictAdapter": ".state_dict_adapter",
    "from_pretrained": ".hf_checkpoint",
    "get_flavor": ".flavors",
    "load_hf_state_dict": ".hf_checkpoint",
    "qwen35_moe_flavors": ".flavors",
    "save_hf_checkpoint": ".hf_checkpoint",
}
__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name], __name__), name)
