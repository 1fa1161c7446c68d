"""Model construction shared by the tests: the meta -> materialise -> init path the trainer takes."""

import torch

from models.qwen35_moe import Qwen35MoeArgs, Qwen35MoeModel


def initialized_model(args: Qwen35MoeArgs, seed: int = 0) -> Qwen35MoeModel:
    """An fp32 CPU model with the HF-like init, reproducible from `seed`."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Qwen35MoeModel(args)
    model.to_empty(device="cpu")
    model.init_weights()
    return model
