"""Applies context parallelism, activation checkpointing, compile and FSDP2 to a Qwen3.5-MoE model, in that fixed
order (CP only attaches its exchanges to the mixers; AC and compile wrap each block before FSDP groups the
blocks' parameters)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from models.qwen35_moe.attention import GatedAttention
from models.qwen35_moe.gated_delta_net_fp32 import Fp32ParamsModule
from models.qwen35_moe.gated_deltanet import CPAwareGatedDeltaNet

from .context_parallel import CPContext


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh) -> None:
    """Attach the CP group's exchanges to the model (which learns the whole rows' documents once per forward)
    and to every mixer: Gated DeltaNet goes head-parallel, attention gathers keys and values. Every other
    module works token by token and needs nothing."""
    context = CPContext(cp_mesh)
    model._cp = context
    for module in model.modules():
        if isinstance(module, CPAwareGatedDeltaNet):
            module._cp_mesh, module._cp = cp_mesh, context
        elif isinstance(module, GatedAttention):
            module._cp = context


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
    # No cast: these units all-gather, compute and reduce in their parameters' own dtype, fp32 by contract.
    fp32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=None, cast_forward_inputs=False)
    for layer in model.layers.values():
        for module in layer.modules():
            if isinstance(module, Fp32ParamsModule):
                fully_shard(module, mesh=mesh, mp_policy=fp32)
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def parallelize_qwen35_moe(model: nn.Module, mesh: DeviceMesh | None, *, param_dtype: torch.dtype,
                           reduce_dtype: torch.dtype, ac_mode: str, compile: bool,
                           cp_mesh: DeviceMesh | None = None) -> nn.Module:
    """`mesh`: the FSDP mesh (shard, or replicate x shard), None for a single process; `cp_mesh`: this rank's
    context-parallel group, None without context parallelism."""
    if cp_mesh is not None:
        apply_context_parallel(model, cp_mesh)
    apply_activation_checkpointing(model, ac_mode)
    if compile:
        apply_compile(model)
    if mesh is not None:
        apply_fsdp(model, mesh, param_dtype, reduce_dtype)
    return model
