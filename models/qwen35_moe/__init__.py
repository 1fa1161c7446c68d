"""Native Qwen3.5-MoE (hybrid Gated DeltaNet + gated attention + sparse MoE) for training."""

from .args import Qwen35MoeArgs
from .flavors import get_flavor, qwen35_moe_flavors
from .hf_checkpoint import from_pretrained, load_hf_state_dict, save_hf_checkpoint
from .model import CausalLMOutput, Qwen35MoeModel
from .state_dict_adapter import Qwen35MoeStateDictAdapter

__all__ = [
    "CausalLMOutput",
    "Qwen35MoeArgs",
    "Qwen35MoeModel",
    "Qwen35MoeStateDictAdapter",
    "from_pretrained",
    "get_flavor",
    "load_hf_state_dict",
    "qwen35_moe_flavors",
    "save_hf_checkpoint",
]
