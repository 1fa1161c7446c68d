"""Applies activation checkpointing, compile and FSDP2 to a Qwen3.5-MoE model, in that fixed order
(AC and compile wrap each block before FSDP groups the blocks' parameters)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from models.qwen35_moe.gated_delta_net_fp32 import Fp32ParamsModule


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """"full": recompute every decoder block in backward; "selective": every second block (half the
    recompute for roughly half the activation memory saved)."""
    if mode == "none":
        return
    for name, layer in list(model.layers.items()):
        if mode == "full" or int(name) % 2 == 0:
            model.layers[name] = checkpoint_wrapper(layer, preserve_rng_state=False)


def apply_compile(model: nn.Module) -> None:
    """torch.compile each decoder block in place (keeps state-dict keys free of an `_orig_mod.` prefix)."""
    for layer in model.layers.values():
        layer.compile(fullgraph=False)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
    """FSDP2 per decoder block plus the root (embedding, final norm, lm_head).

    The fp32 contract (docs/design.md): each GDN layer's SSMGate (`linear_attn._fp32_params`) and output norm
    (`linear_attn.norm`) is its own unit with an fp32 policy, so A_log, dt_bias and the norm weight are
    all-gathered, used and given gradients in fp32 even when the rest of the block computes in bf16.
    Their inputs are not cast (they upcast internally and return the caller's dtype).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for layer in model.layers.values():
        for module in layer.modules():
            if isinstance(module, Fp32ParamsModule):
                fully_shard(module, mesh=mesh, mp_policy=fp32)
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def parallelize_qwen35_moe(model: nn.Module, mesh: DeviceMesh | None, *, param_dtype: torch.dtype,
                           reduce_dtype: torch.dtype, ac_mode: str, compile: bool) -> nn.Module:
    apply_activation_checkpointing(model, ac_mode)
    if compile:
        apply_compile(model)
    if mesh is not None:
        apply_fsdp(model, mesh, param_dtype, reduce_dtype)
    return model
