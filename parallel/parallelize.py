"""Applies context and expert parallelism, compile, activation checkpointing and FSDP2 to a Qwen3.5-MoE model, in
that fixed order (CP only attaches its exchanges to the mixers, EP shards the experts' weights over its mesh and
attaches its exchange to the MoE layers; compile, then AC, wrap each block before FSDP groups the blocks'
parameters)."""

from __future__ import annotations

import logging
import types

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from models.qwen35_moe.attention import GatedAttention
from models.qwen35_moe.fp32_contract import Fp32ParamsModule
from models.qwen35_moe.gated_deltanet import CPAwareGatedDeltaNet
from models.qwen35_moe.moe import RoutedExperts, SparseMoE

from .activation_checkpointing import apply_activation_checkpointing
from .context_parallel import CPContext
from .expert_parallel import AllGatherExpertParallel, ExpertParallel, resolve_dispatch, shard_experts
from .replicated_params import ReplicatedParams
from .vocab_parallel import apply_vocab_parallel

logger = logging.getLogger(__name__)


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


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, dispatch: str = "auto") -> None:
    """Split every MoE layer's routed experts over the EP mesh and route its tokens through `dispatch`'s exchange
    ("auto": by the EP size against the layer's top-k, `resolve_dispatch`; one exchange per layer: the all-to-all
    keeps the layer's split sizes for the activation-checkpointing recompute)."""
    exchanges = {"all_gather": AllGatherExpertParallel, "all_to_all": ExpertParallel}
    chosen = set()
    for module in model.modules():
        if isinstance(module, SparseMoE):
            shard_experts(module.experts, ep_mesh)
            name = resolve_dispatch(dispatch, ep_mesh.size(), module.top_k)
            module._ep = exchanges[name](ep_mesh)
            chosen.add(name)
    logger.info("expert parallelism: %d ranks, %s dispatch", ep_mesh.size(), " / ".join(sorted(chosen)))


def apply_compile(model: nn.Module, first_block_own_frames: bool = False) -> None:
    """torch.compile each decoder block in place (keeps state-dict keys free of an `_orig_mod.` prefix).

    `first_block_own_frames`: the first block runs a copy of the blocks' forward. Under FSDP without expert
    parallelism its routed experts are an FSDP unit of their own (apply_fsdp), whose hooks break its compiled graph
    at the MoE call. Dynamo keeps its compiled frames per code object, and its guards skip FSDP-managed modules, so
    every block reused the first block's frames, break included: the MoE and the residual add after it as two more
    graphs per block (a profiled FSDP=2 step at 8 layers: 60 compiled-function calls in the forward against one
    GPU's 40; tests/distributed/test_compiled_frames.py). A copy of the code keeps those frames the first
    block's own."""
    layers = list(model.layers.values())
    if first_block_own_frames:
        forward = type(layers[0]).forward
        code_copy = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                                       forward.__defaults__, forward.__closure__)
        layers[0].forward = types.MethodType(code_copy, layers[0])
    for layer in layers:
        layer.compile(fullgraph=False)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               expert_mesh: DeviceMesh | None = None, reshard_after_forward: bool = True,
               vocab_parallel: bool = False) -> None:
    """FSDP2 units: each decoder block, the first block's routed experts, the embedding, the lm_head, and the root
    (tied embeddings' one matrix, if any); each GDN layer's fp32 parameters and the final norm's weight are whole
    on every rank instead (below). With `vocab_parallel` the embedding and the lm_head are not FSDP's: their
    weights stay sharded by rows over the same mesh and the tokens travel instead (parallel/vocab_parallel.py).
    `reshard_after_forward` False keeps every unit's gathered weights from its forward to its backward; True (the
    default) frees them, except where the backward comes at once or needs no weights:

    - The embedding and the lm_head (a billion parameters at 35B-A3B's 248k vocabulary) are units of their own, as
      in torchtitan. In the root they were gathered before the first block and their gradients reduced after the
      last block's backward, with no compute to hide either behind. Now the head is gathered while the blocks
      compute and its gradient (ready when its forward ends, linear_cross_entropy.py) is reduced while the blocks'
      backward runs.
    - The lm_head and the last block stay gathered after their forward: their backward follows at once.
    - The embedding is never gathered for backward: a lookup's backward needs the ids, not the table.
    - The first block's routed experts (most of its weights) are a unit of their own, gathered while its attention
      computes. The first block's gradients are the step's last reduction, which nothing can hide: the optimizer
      waits for it. Split, the experts' share is reduced while the block's attention runs backward, leaving only
      the rest (a sixth at 35B-A3B widths and 64 experts) exposed. The unit's hooks break the first block's
      compiled MoE (only the first block's: apply_compile gives it its own copy of the forward's code, which
      parallelize_qwen35_moe asks for wherever this unit exists); no such unit was still slower (2 x H200,
      2026-11-27: 76.6k and 80.5k tokens/s per GPU against 79.9k and 81.2k; 55.2k against 58.8k at 8 layers).
    - Each forward gathers ahead: the root the first block (and the embedding, if a unit) as the step starts, each
      block the next one (the last, the lm_head) as it starts. Left to FSDP, a block was gathered only once the
      host had queued the previous block's work, which under compile's graph breaks comes late: a profiled
      FSDP=2 step's blocks waited 1-7 ms each for their gather.

    Under expert parallelism each MoE layer's routed experts are their own unit on `expert_mesh` (the data-parallel
    ranks left once EP has split the experts), sharded on dim 1 (dim 0 is EP's: sharding it twice would make
    the strided layouts that checkpoints must then understand). FSDP averages their gradients over that mesh
    only: the trainer completes the average (`scale_expert_gradients`). Where that mesh is one rank (ep equal to
    dp_shard x cp, e.g. EP=2 on 2 GPUs) the experts are left out of FSDP altogether: sharding over one rank would
    only copy them (cast, gather, split, and their gradients' concatenation) several times a step. They are cast
    where they are used instead (models/qwen35_moe/linear.py) and their gradients need no reduction.

    The fp32 contract (docs/design.md): each GDN layer's fp32 parameters (SSMGate's A_log and dt_bias, the output
    norm's weight; ~200 values) are left out of FSDP and kept whole on every rank, in fp32, their gradients
    averaged over the mesh by one all-reduce when the backward ends (parallel/replicated_params.py). As a unit of
    their own with an fp32 policy they cost each GDN layer an all-gather, a reduce-scatter and four FSDP hooks a
    step: a quarter of FSDP's host time in a profiled FSDP=2 step. The final norm's weight (hidden size values, cast
    where it is used as FSDP would cast it, models/qwen35_moe/norms.py) is whole on every rank too: as the root's
    only parameter it cost an all-gather that opened every step, a point where the ranks wait for each other, and
    a reduction that closed it, behind everything else.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # The root and the lm_head take no floating input that needs a cast (ids, the layout's integers, and hidden
    # states already in the compute dtype), and one that must not be cast: the loss's fp32 gradient scale.
    mp_uncast = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    unsharded_experts = expert_mesh is not None and expert_mesh.size() == 1
    layers = list(model.layers.values())
    prefetches = []  # per block, what its forward gathers ahead: its nested units, then the next block
    resharded = []  # the units inside the blocks that free their weights after forward (reshard_policy.py)
    replicated = []  # modules whose parameters are whole on every rank: the GDN layers' fp32 ones, the final norm
    for index, layer in enumerate(layers):
        ignored, prefetch = set(), []
        keep = not reshard_after_forward or index == len(layers) - 1
        for module in layer.modules():
            if isinstance(module, Fp32ParamsModule):
                ignored.update(module.parameters())
                replicated.append(module)
            elif isinstance(module, RoutedExperts) and unsharded_experts:
                ignored.update(module.parameters())
            elif isinstance(module, RoutedExperts) and expert_mesh is not None:
                fully_shard(module, mesh=expert_mesh, mp_policy=mp, shard_placement_fn=lambda _: Shard(1),
                            reshard_after_forward=not keep)
            elif isinstance(module, RoutedExperts) and index == 0:
                fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=not keep)
                prefetch.append(module)
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=not keep, ignored_params=ignored or None)
        if not keep:  # the block's nested units (its experts, where they are one), then the block
            resharded += [m for m in layer.modules() if isinstance(m, FSDPModule) and m is not layer] + [layer]
        prefetches.append(prefetch)
    model.fsdp_resharded_units = resharded
    vocab_params = apply_vocab_parallel(model, mesh, param_dtype) if vocab_parallel else []
    # Units of their own unless vocabulary-parallel; tied, the two share one parameter, which the root keeps.
    if not vocab_parallel and model.lm_head.weight is not model.embed_tokens.weight:
        fully_shard(model.embed_tokens, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        model.embed_tokens.set_unshard_in_backward(False)
        fully_shard(model.lm_head, mesh=mesh, mp_policy=mp_uncast, reshard_after_forward=False)
    replicated.append(model.norm)
    fully_shard(model, mesh=mesh, mp_policy=mp_uncast, reshard_after_forward=reshard_after_forward,
                ignored_params={*vocab_params, *model.norm.parameters()})
    model.replicated_params = ReplicatedParams(model, replicated, mesh)
    first = [model.embed_tokens] if isinstance(model.embed_tokens, FSDPModule) else []
    model.set_modules_to_forward_prefetch([*first, layers[0]])
    after_last = [model.lm_head] if isinstance(model.lm_head, FSDPModule) else []
    for layer, prefetch, following in zip(layers, prefetches, [[block] for block in layers[1:]] + [after_last]):
        layer.set_modules_to_forward_prefetch(prefetch + following)


def reshard_fsdp(model: nn.Module) -> None:
    """Free the weights that FSDP units still hold gathered: after a forward without a backward (validation)
    under `reshard_after_forward=False` they would otherwise stay gathered, in the compute dtype, and a
    state dict taken then would hold them in place of the fp32 shards."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def parallelize_qwen35_moe(model: nn.Module, mesh: DeviceMesh | None, *, param_dtype: torch.dtype,
                           reduce_dtype: torch.dtype, ac_mode: str, compile: bool,
                           cp_mesh: DeviceMesh | None = None, ep_mesh: DeviceMesh | None = None,
                           expert_fsdp_mesh: DeviceMesh | None = None, expert_dispatch: str = "auto",
                           reshard_after_forward: bool = True, vocab_parallel: bool = False) -> nn.Module:
    """`mesh`: the FSDP mesh (shard, or replicate x shard), None for a single process; `cp_mesh`: this rank's
    context-parallel group, None without context parallelism; `ep_mesh` / `expert_fsdp_mesh`: the expert-parallel
    group and the FSDP mesh of the experts' weights, None without expert parallelism; `expert_dispatch`: how
    tokens reach the experts' ranks ("auto", "all_gather" or "all_to_all", parallel/expert_parallel.py);
    `vocab_parallel`: the embedding and the lm_head vocabulary-parallel over the FSDP mesh (vocab_parallel.py).

    One rank (one GPU, or a single process) gets no FSDP: its weights stay whole fp32 parameters and, given a
    `param_dtype`, the model computes in it (`model.compute_dtype`), casting each weight where it is used, as
    FSDP's mixed precision would, without FSDP's copies and hooks (one GPU ran ~25 ms of a ~190 ms step in them)."""
    if cp_mesh is not None:
        apply_context_parallel(model, cp_mesh)
    if ep_mesh is not None:
        apply_expert_parallel(model, ep_mesh, expert_dispatch)
    # Compile first, then checkpoint the compiled block: compile over a checkpointed block would have to trace the
    # checkpoint whole, and a block with graph breaks (FLA's kernels, EP's exchange) cannot be; dynamo then runs
    # the whole block eagerly, in the forward and in the recompute (on one H200 full AC then cost 39% of the
    # no-AC speed, against 15% compiled). Full AC compiles the blocks itself, in two halves
    # (activation_checkpointing.py).
    if compile and ac_mode != "full":
        # apply_fsdp makes the first block's experts a unit of their own where FSDP runs without EP's expert mesh
        apply_compile(model, first_block_own_frames=mesh is not None and mesh.size() > 1 and expert_fsdp_mesh is None)
    apply_activation_checkpointing(model, ac_mode, compiled=compile)
    if mesh is not None and mesh.size() > 1:
        apply_fsdp(model, mesh, param_dtype, reduce_dtype, expert_fsdp_mesh, reshard_after_forward, vocab_parallel)
    else:  # one rank: nothing to shard; the fp32 weights are cast where they are used (linear.py)
        model.compute_dtype = param_dtype
    return model
