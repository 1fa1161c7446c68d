"""Initial weights that depend on the seed and the parameter's name only, never on how the model is sharded.

Each parameter is drawn from its own generator, seeded from (seed, parameter name), as one full tensor on the
parameter's device; a sharded parameter (a DTensor, e.g. under FSDP2) then keeps its own slice of it. One
process and any number of ranks, whatever the mesh, therefore start from the same weights (on one device
type: CPU and CUDA generators draw different numbers). The price is one full parameter of temporary memory
at a time (2 GiB for the largest, the 35B-A3B embedding, in fp32).

The rules, by parameter (HF-like, as transformers initialises Qwen3.5-MoE):
  A_log                     log U(0.01, 16)      (decay rates A ~ U(0.01, 16); the bound keeps log(A) finite)
  dt_bias                   1
  linear_attn.norm.weight   1                    (gated RMSNorm scale)
  other *norm.weight        0                    (zero-centred RMSNorms: scale 1 + w; also the MTP's
                                                  mtp.pre_fc_norm_{embedding,hidden}.weight)
  conv1d.weight             U(-1/sqrt(W), 1/sqrt(W))  (PyTorch's Conv1d default, as FLA's ShortConvolution)
  *.adapter.*_A             U(-1/sqrt(in), 1/sqrt(in))  (LoRA, lora.py: PEFT's default)
  *.adapter.*_B             0                    (LoRA starts from the base model exactly)
  *.bias                    0
  everything else           N(0, initializer_range)   (projections, experts, router, embedding, lm_head)
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from .hooks import UNSHARDED, ParamSharding, canonical_name


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    # A digest of both, stable across processes (hash() of a str is salted per process); every bit depends on
    # both, since the CPU generator (mt19937) only uses the low 32 bits of its seed.
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def initial_value(name: str, shape: torch.Size, std: float, generator: torch.Generator) -> torch.Tensor:
    """The full initial fp32 tensor of parameter `name` (a state-dict key) drawn from `generator`."""
    device = generator.device
    full = torch.empty(shape, dtype=torch.float32, device=device)
    if ".adapter." in name:  # LoRA's (lora.py)
        if name.endswith(("lora_B", "_B")):
            return full.zero_()
        bound = 1.0 / math.sqrt(shape[-1])
        return full.uniform_(-bound, bound, generator=generator)
    if name.endswith("A_log"):
        return full.uniform_(0.01, 16, generator=generator).log_()
    if name.endswith(("dt_bias", "linear_attn.norm.weight")):
        return full.fill_(1.0)
    if name.endswith(("norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", ".bias")):
        return full.zero_()
    if name.endswith("conv1d.weight"):
        bound = 1.0 / math.sqrt(shape[-1])
        return full.uniform_(-bound, bound, generator=generator)
    return full.normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, std: float, sharding: ParamSharding = UNSHARDED) -> None:
    """Initialise every parameter of `model` in place; the same values at any world size and mesh. `sharding`
    (hooks.py) takes each rank's part of the whole tensor every rank draws (no communication)."""
    for raw_name, param in model.named_parameters():
        name = canonical_name(raw_name)
        local = sharding.local(param)
        full = initial_value(name, param.shape, std, _generator(seed, name, local.device))
        local.copy_(sharding.local_part(param, full))
