"""Activation checkpointing of the decoder blocks.

"full" keeps each block's input and recomputes the block in the backward; "selective" keeps, per op, the matmul,
attention and collective outputs and recomputes the elementwise work between them.

Compiled blocks under full AC are checkpointed in two halves (`checkpoint_compiled_halves`):

- The mixer half (norm, Gated DeltaNet or attention, residual) has graph breaks (FLA's kernels, the flash varlen
  call), and dynamo cannot trace a checkpoint around a graph break: it would run the whole region eagerly. So the
  half is compiled up to the mixer's output projection, and an eager checkpoint reruns its compiled graphs in the
  backward, as it did for whole blocks; the projection runs eagerly, so that the recompute stops before it
  (`_mixer_half_projected_eagerly`).
- The MoE half (norm, router, experts, shared expert, residual) has no graph break on the GPU, so the checkpoint is
  compiled with it and the recompute becomes part of the compiled backward: inductor's partitioner recomputes only
  what the backward reads (not the experts' weighted combine, nor the residual sum), fuses the recomputed
  elementwise work into the backward's kernels, and keeps the routing (`_keep_in_moe_half`: the top-k and the
  expert sort, a few hundred KiB a layer). Where the half does break the graph (expert parallelism's exchange, the
  CPU reference experts, the routed experts as an FSDP unit of their own) dynamo says so at the first forward, and
  that block's MoE half is checkpointed eagerly around its compiled graphs instead.

H200s, 8 layers / 32 experts at 35B-A3B's widths, compiled: full AC cost 13.2-15.1% of the no-AC tokens/s where
whole compiled blocks in an eager checkpoint cost 15.7-16.1% in the same calls, for +0.3 GiB (each block keeps
its middle too). Also keeping the experts' gate-up GEMM output (+1 GiB) was not faster (README "Speed").
"""

from __future__ import annotations

import functools
import logging
import types

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from models.qwen35_moe.model import DecoderLayer

logger = logging.getLogger(__name__)


def _saved_ops() -> set:
    """What selective checkpointing keeps from the forward: the outputs of the matmuls (projections, experts'
    grouped GEMMs), of the attention kernels and of the collectives (context parallelism's exchanges), the
    expensive ops whose outputs are small next to the elementwise chains (norms, activations, gates, RoPE,
    routing) that are recomputed instead. FLA's Gated DeltaNet kernels (Triton, inside an autograd Function)
    are not aten ops: they run again in the recompute."""
    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    names = [(aten, "mm"), (aten, "addmm"), (aten, "bmm"), (aten, "_grouped_mm"),
             (aten, "_scaled_dot_product_flash_attention"), (aten, "_scaled_dot_product_efficient_attention"),
             (aten, "_scaled_dot_product_cudnn_attention"), (aten, "_flash_attention_forward"),
             (aten, "_efficient_attention_forward"), (c10d, "all_gather_into_tensor"),
             (c10d, "reduce_scatter_tensor"), (c10d, "all_to_all_single")]
    return {getattr(ns, name).default for ns, name in names if hasattr(ns, name)}


def _ignore_profiler_ops_in_selective_checkpointing() -> None:
    """FSDP2's hooks of the units nested in a block (the first block's experts, EP's experts) run inside its
    checkpointed region and open profiler ranges (`record_function`) a different number of times in the forward
    and in the recompute; selective checkpointing matches every op's calls between the two, so it must not count
    these (they compute nothing)."""
    from torch.utils import checkpoint as checkpoint_module

    if not hasattr(checkpoint_module, "SAC_IGNORED_OPS"):  # a torch whose SAC does not match recomputed ops' calls
        return
    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
        packet = getattr(torch.ops.profiler, name, None)
        for overload in packet.overloads() if packet is not None else []:
            checkpoint_module.SAC_IGNORED_OPS.add(getattr(packet, overload))


def _selective_policy(saved: set):
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def _keep_in_moe_half(ctx, op, *args, **kwargs):
    """What the compiled MoE half's recompute reuses from the forward: the routing (see the module docstring)."""
    if op in (torch.ops.aten.topk.default, torch.ops.aten.sort.stable, torch.ops.aten.sort.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed_moe_half(layer: DecoderLayer, h: torch.Tensor):
    return checkpoint(DecoderLayer.moe_half, layer, h, use_reentrant=False, preserve_rng_state=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, _keep_in_moe_half))


@functools.cache
def _compiled() -> types.SimpleNamespace:
    """The compiled halves, shared by every block (dynamo keys its graphs on the code and guards on what differs
    between blocks); made at first use, as `torch.compile` imports inductor (~1 s)."""
    return types.SimpleNamespace(mixer_core=torch.compile(DecoderLayer.mixer_core),
                                 moe_half=torch.compile(DecoderLayer.moe_half),
                                 checkpointed_moe_half=torch.compile(_checkpointed_moe_half, fullgraph=True))


def _mixer_half_projected_eagerly(layer: DecoderLayer, h: torch.Tensor, layout) -> torch.Tensor:
    """The mixer half, its output projection outside the compiled graphs. In the recompute, the checkpoint stops
    (early stop, torch's default) as soon as the last tensor the backward needs is saved again, which is the
    projection's input: an eager GEMM saves its inputs before it runs, so the projection and the residual sum,
    whose outputs no backward reads, are not recomputed (a compiled graph saves its tensors after it has run)."""
    return h + layer.mixer.project(_compiled().mixer_core(layer, h, layout))


_fallbacks_logged: set[str] = set()


def _forward_in_checkpointed_halves(layer: DecoderLayer, h: torch.Tensor, layout):
    h = checkpoint(_mixer_half_projected_eagerly, layer, h, layout, use_reentrant=False, preserve_rng_state=False)
    if layer.moe_half_traced is not False:
        try:
            out = _compiled().checkpointed_moe_half(layer, h)
        except torch._dynamo.exc.Unsupported as error:  # a graph break, found while tracing: nothing has run
            if layer.moe_half_traced:
                raise
            layer.moe_half_traced = False
            reason = str(error).splitlines()[0]
            if reason not in _fallbacks_logged:  # once per cause, not once per block
                _fallbacks_logged.add(reason)
                logger.info("activation checkpointing: a block's MoE half breaks the compiled graph (%s); its "
                            "checkpoint reruns its compiled graphs instead", reason)
        else:
            layer.moe_half_traced = True
            return out
    return checkpoint(_compiled().moe_half, layer, h, use_reentrant=False, preserve_rng_state=False)


def checkpoint_compiled_halves(layer: DecoderLayer) -> None:
    """Full AC for a compiled block, in place: its forward becomes the two checkpointed halves of the module
    docstring (its parameters, and so the state dict's keys, are untouched). Replaces `layer.compile()`."""
    layer.moe_half_traced = None  # decided at the first forward: whether dynamo traced the MoE half's checkpoint
    layer.forward = types.MethodType(_forward_in_checkpointed_halves, layer)


def apply_activation_checkpointing(model: nn.Module, mode: str, compiled: bool = False) -> None:
    """"full": keep only each decoder block's input and recompute the block in backward; "selective": per op,
    keep the matmul, attention and collective outputs and recompute the elementwise work between them
    (`_saved_ops`). `compiled`: the blocks are to be compiled; under "full" that is done here, in two halves
    (`checkpoint_compiled_halves`), under "selective" the caller compiles each block first."""
    if mode == "none":
        return
    if mode == "full" and compiled:
        for layer in model.layers.values():
            checkpoint_compiled_halves(layer)
        return
    kwargs = {}
    if mode == "selective":
        _ignore_profiler_ops_in_selective_checkpointing()
        policy = _selective_policy(_saved_ops())
        kwargs["context_fn"] = lambda: create_selective_checkpoint_contexts(policy)
    for name, layer in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(layer, preserve_rng_state=False, **kwargs)
