"""Activation checkpointing of the decoder blocks, as each block's `runner` (models/qwen35_moe/hooks.py): the
parameters, and with them the state dict's keys, stay as they are.

"full" keeps each block's input and recomputes the block in the backward; "selective" keeps, per op, the matmul,
attention and collective outputs and recomputes the elementwise work between them.

Compiled blocks under full AC are checkpointed in two halves (`checkpoint_compiled_halves`):

- The mixer half (norm, Gated DeltaNet or attention, residual) has graph breaks (FLA's kernels, the flash varlen
  call), and dynamo cannot trace a checkpoint around a graph break: it would run the whole region eagerly. So the
  half is compiled up to the mixer's output projection, and an eager checkpoint reruns its compiled graphs in the
  backward; the projection runs eagerly, so that the recompute stops before it (`_mixer_half_projected_eagerly`).
- The MoE half (norm, router, experts, shared expert, residual) has no graph break on the GPU, so the checkpoint is
  compiled with it and the recompute becomes part of the compiled backward: inductor's partitioner recomputes only
  what the backward reads (not the experts' weighted combine, nor the residual sum), fuses the recomputed
  elementwise work into the backward's kernels, and keeps the routing (`_keep_in_moe_half`: the top-k and the
  expert sort, a few hundred KiB a layer). Where the half does break the graph (expert parallelism's exchange, the
  CPU reference experts, the routed experts as an FSDP unit of their own) dynamo says so at the first forward, and
  that block's MoE half is checkpointed eagerly around its compiled graphs instead.

Halves against whole compiled blocks in an eager checkpoint: docs/performance.md, "Activation checkpointing".
"""

from __future__ import annotations

import functools
import logging
import types

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from models.qwen35_moe.hooks import BlockRunner
from models.qwen35_moe.model import DecoderLayer

from .torch_internals import (
    functional_collective_ops,
    graph_break_error,
    ignore_profiler_ranges_in_selective_checkpointing,
)

logger = logging.getLogger(__name__)


def _saved_ops() -> set:
    """What selective checkpointing keeps from the forward: the outputs of the matmuls (projections, experts'
    grouped GEMMs), of the attention kernels and of the collectives (context parallelism's exchanges), the
    expensive ops whose outputs are small next to the elementwise chains (norms, activations, gates, RoPE,
    routing) that are recomputed instead. FLA's Gated DeltaNet kernels (Triton, inside an autograd Function)
    are not aten ops: they run again in the recompute."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "_grouped_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_flash_attention_forward", "_efficient_attention_forward"]
    return {getattr(aten, name).default for name in names if hasattr(aten, name)} | functional_collective_ops()


def _selective_context():
    saved = _saved_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


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
    between blocks); made at first use, as `torch.compile` imports inductor, which is slow to import."""
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


class CheckpointedCompiledHalves:
    """Full AC of a compiled block, in the two halves of the module docstring: one runner per block, which learns at
    the block's first forward whether dynamo traces its MoE half with the checkpoint (`moe_half_traced`)."""

    def __init__(self):
        self.moe_half_traced: bool | None = None

    def __call__(self, layer: DecoderLayer, h: torch.Tensor, layout):
        h = checkpoint(_mixer_half_projected_eagerly, layer, h, layout, use_reentrant=False, preserve_rng_state=False)
        if self.moe_half_traced is not False:
            try:
                out = _compiled().checkpointed_moe_half(layer, h)
            except graph_break_error() as error:  # a graph break, found while tracing: nothing has run
                if self.moe_half_traced:
                    raise
                self.moe_half_traced = False
                reason = str(error).splitlines()[0]
                if reason not in _fallbacks_logged:  # once per cause, not once per block
                    _fallbacks_logged.add(reason)
                    logger.info("activation checkpointing: a block's MoE half breaks the compiled graph (%s); its "
                                "checkpoint reruns its compiled graphs instead", reason)
            else:
                self.moe_half_traced = True
                return out
        return checkpoint(_compiled().moe_half, layer, h, use_reentrant=False, preserve_rng_state=False)


class Checkpointed:
    """A runner inside a checkpoint: "full" keeps the block's input only, "selective" also the outputs of
    `_saved_ops`."""

    def __init__(self, inner: BlockRunner, selective: bool):
        self.inner, self.selective = inner, selective
        if selective:
            ignore_profiler_ranges_in_selective_checkpointing()

    def __call__(self, layer: DecoderLayer, h: torch.Tensor, layout):
        kwargs = {"context_fn": _selective_context} if self.selective else {}
        return checkpoint(self.inner, layer, h, layout, use_reentrant=False, preserve_rng_state=False, **kwargs)


def checkpointed_runners(runners: list[BlockRunner], mode: str, compiled: bool) -> list[BlockRunner]:
    """Each block's runner under activation checkpointing `mode`: "none" leaves them; "full" keeps only each
    block's input (compiled: `CheckpointedCompiledHalves`, which compiles the halves itself, in place of the
    compiled runners); "selective" keeps the outputs of `_saved_ops` and recomputes the elementwise work between
    them (around the compiled runners, if any)."""
    if mode == "none":
        return runners
    if mode == "full" and compiled:
        return [CheckpointedCompiledHalves() for _ in runners]
    return [Checkpointed(runner, selective=mode == "selective") for runner in runners]
