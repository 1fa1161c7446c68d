"""Parallelizes a Qwen3.5-MoE model in a fixed order: context parallelism (the CP group's exchanges), expert
parallelism (the experts' weights sharded over the EP mesh, a dispatch per MoE layer), compile, activation
checkpointing (each block's runner), vocabulary parallelism (the embedding's and lm_head's rows sharded), then
FSDP2 groups the blocks' parameters. Everything the model reads is given to it in one call,
`model.set_parallel_hooks` (models/qwen35_moe/hooks.py); the rest transforms parameters, as FSDP does."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from models.qwen35_moe.fp32_contract import Fp32ParamsModule
from models.qwen35_moe.hooks import ParallelHooks
from models.qwen35_moe.moe import RoutedExperts, SparseMoE

from .activation_checkpointing import checkpointed_runners
from .compile import compiled_runners
from .context_parallel import CPContext
from .expert_parallel import AllGatherExpertParallel, ExpertParallel, resolve_dispatch, shard_experts
from .one_device_precision import OneDevicePrecision
from .replicated_params import ReplicatedParams
from .step_gradients import StepGradients
from .vocab_parallel import shard_vocab_rows

logger = logging.getLogger(__name__)


class DTensorSharding:
    """models/qwen35_moe/hooks.ParamSharding for the parameters FSDP2, expert and vocabulary parallelism make
    DTensors (the others are whole)."""

    def local(self, param: torch.Tensor) -> torch.Tensor:
        return param.to_local() if isinstance(param, DTensor) else param

    def local_part(self, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        if not isinstance(param, DTensor):
            return full
        # src_data_rank=None: slice locally, no communication (every rank holds the same full tensor).
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()


def shard_experts_for_dispatch(model: nn.Module, ep_mesh: DeviceMesh, dispatch: str = "auto"):
    """Shard every MoE layer's routed experts over the EP mesh; returns the factory of each layer's dispatch
    ("auto": by the EP size against the layer's top-k, `resolve_dispatch`; one exchange per layer: the all-to-all
    keeps the layer's split sizes for the activation-checkpointing recompute)."""
    exchanges = {"all_gather": AllGatherExpertParallel, "all_to_all": ExpertParallel}
    chosen = set()
    for module in model.modules():
        if isinstance(module, SparseMoE):
            shard_experts(module.experts, ep_mesh)
            chosen.add(resolve_dispatch(dispatch, ep_mesh.size(), module.top_k))
    logger.info("expert parallelism: %d ranks, %s dispatch", ep_mesh.size(), " / ".join(sorted(chosen)))
    return lambda moe: exchanges[resolve_dispatch(dispatch, ep_mesh.size(), moe.top_k)](ep_mesh)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               expert_mesh: DeviceMesh | None = None, reshard_after_forward: bool = True,
               vocab_params: list[nn.Parameter] = (), train_mtp: bool = False) -> None:
    """FSDP2 units: each decoder block, the first block's routed experts, the embedding, the lm_head, and the root
    (tied embeddings' one matrix, if any); each GDN layer's fp32 parameters and the final norm's weight are whole
    on every rank instead (below). `vocab_params`: the embedding's and lm_head's weights already sharded by rows
    over the same mesh (vocabulary parallelism, parallel/vocab_parallel.py), which FSDP leaves alone.
    `reshard_after_forward` False keeps every unit's gathered weights from its forward to its backward; True (the
    default) frees them, except where the backward comes at once or needs no weights:

    - The embedding and the lm_head (a billion parameters at 35B-A3B's 248k vocabulary) are units of their own, as
      in torchtitan. In the root they would be gathered before the first block and their gradients reduced after
      the last block's backward, with no compute to hide either behind. As units, the head is gathered while the
      blocks compute and its gradient (ready when its forward ends, linear_cross_entropy.py) is reduced while the
      blocks' backward runs.
    - The lm_head (tied: the root's one matrix) and the last block stay gathered after their forward: their
      backward follows at once.
    - The embedding is never gathered for backward: a lookup's backward needs the ids, not the table.
    - The first block's routed experts (most of its weights) are a unit of their own, gathered while its attention
      computes. The first block's gradients are the step's last reduction, which nothing can hide: the optimizer
      waits for it. Split, the experts' share is reduced while the block's attention runs backward, leaving only
      the rest (a sixth at 35B-A3B widths and 64 experts) exposed. The unit's hooks break the first block's
      compiled MoE (only the first block's: compile.py gives it frames of its own, which parallelize_qwen35_moe
      asks for wherever this unit exists); without the unit FSDP=2 is slower (docs/performance.md, "Tried, not
      kept").
    - Each forward gathers ahead: the root the first block (and the embedding, if a unit) as the step starts, each
      block the next one (the last, the lm_head) as it starts. Left to FSDP, a block is gathered only once the
      host has queued the previous block's work, which under compile's graph breaks comes late, and the blocks
      wait for their gathers (docs/performance.md, "Tried, not kept").

    Under expert parallelism each MoE layer's routed experts are their own unit on `expert_mesh` (the data-parallel
    ranks left once EP has split the experts), sharded on dim 1 (dim 0 is EP's: sharding it twice would make
    the strided layouts that checkpoints must then understand). FSDP averages their gradients over that mesh
    only: the trainer completes the average (`scale_expert_gradients`). Where that mesh is one rank (ep equal to
    dp_shard x cp, e.g. EP=2 on 2 GPUs) the experts are left out of FSDP altogether: sharding over one rank would
    only copy them (cast, gather, split, and their gradients' concatenation) several times a step. They are cast
    where they are used instead (models/qwen35_moe/moe.py) and their gradients need no reduction.

    The fp32 contract (docs/design.md): each GDN layer's fp32 parameters (SSMGate's A_log and dt_bias, the output
    norm's weight; ~200 values) are left out of FSDP and kept whole on every rank, in fp32, their gradients
    averaged over the mesh by one all-reduce when the backward ends (parallel/replicated_params.py). As a unit of
    their own with an fp32 policy they cost each GDN layer an all-gather, a reduce-scatter and four FSDP hooks a
    step, a large share of FSDP's host time (docs/performance.md, "Tried, not kept"). The final norm's weight
    (hidden size values, cast where it is used as FSDP would cast it, models/qwen35_moe/norms.py) is whole on every
    rank too: as the root's only parameter it would cost an all-gather that opens every step, a point where the
    ranks wait for each other, and a reduction that closes it, behind everything else.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # The root and the lm_head take no floating input that needs a cast (ids, the layout's integers, and hidden
    # states already in the compute dtype), and one that must not be cast: the loss's fp32 gradient scale.
    mp_uncast = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    unsharded_experts = expert_mesh is not None and expert_mesh.size() == 1
    layers = list(model.layers.values())
    prefetches = []  # per block, what its forward gathers ahead: its nested units, then the next block
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
        prefetches.append(prefetch)
    mtp_units = []
    if model.mtp is not None:  # the MTP layers (run only when a forward asks): a unit of their own, never the root's
        ignored = set()
        for module in model.mtp.modules():
            if isinstance(module, RoutedExperts) and unsharded_experts:
                ignored.update(module.parameters())
            elif isinstance(module, RoutedExperts) and expert_mesh is not None:
                fully_shard(module, mesh=expert_mesh, mp_policy=mp, shard_placement_fn=lambda _: Shard(1),
                            reshard_after_forward=False)
                mtp_units.append(module)
        # Kept gathered after its forward like the last block: the lm_head's forward and then its backward follow.
        fully_shard(model.mtp, mesh=mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored or None)
        mtp_units.insert(0, model.mtp)
    # Units of their own unless vocabulary-parallel; tied, the two share one parameter, which the root keeps.
    if not vocab_params and model.lm_head.weight is not model.embed_tokens.weight:
        fully_shard(model.embed_tokens, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
        model.embed_tokens.set_unshard_in_backward(False)
        fully_shard(model.lm_head, mesh=mesh, mp_policy=mp_uncast, reshard_after_forward=False)
    replicated.append(model.norm)
    # Tied, the root's one matrix is the lm_head's: kept gathered after the forward as the lm_head unit is (its
    # backward comes at once). Freed, its backward would wait on a second gather, and torch 2.11's FSDP hooks no
    # tensor inside the model's output dataclass, so a backward through `logits` would find it freed.
    tied = model.lm_head.weight is model.embed_tokens.weight and not vocab_params
    fully_shard(model, mesh=mesh, mp_policy=mp_uncast, reshard_after_forward=reshard_after_forward and not tied,
                ignored_params={*vocab_params, *model.norm.parameters()})
    ReplicatedParams(model, replicated, mesh)  # lives on in the hooks it registers
    first = [model.embed_tokens] if isinstance(model.embed_tokens, FSDPModule) else []
    model.set_modules_to_forward_prefetch([*first, layers[0]])
    head = [model.lm_head] if isinstance(model.lm_head, FSDPModule) else []
    # Trained, the MTP layers run between the last block and the head (a frozen one never runs: gathered ahead, it
    # would stay gathered)
    after_last = head
    if train_mtp:
        model.mtp.set_modules_to_forward_prefetch(mtp_units[1:] + head)
        after_last = [model.mtp]
    for layer, prefetch, following in zip(layers, prefetches, [[block] for block in layers[1:]] + [after_last]):
        layer.set_modules_to_forward_prefetch(prefetch + following)


def resharding_units(model: nn.Module) -> list[FSDPModule]:
    """The FSDP units apply_fsdp made to free their gathered weights after forward when `reshard_after_forward`:
    every unit inside the blocks but the last (whose backward comes at once), its nested units first."""
    layers = list(model.layers.values())[:-1]
    return [m for layer in layers for m in [*(n for n in layer.modules() if n is not layer), layer]
            if isinstance(m, FSDPModule)]


def reshard_fsdp(model: nn.Module) -> None:
    """Free the weights that FSDP units still hold gathered: after a forward without a backward (validation)
    under `reshard_after_forward=False` they would otherwise stay gathered, in the compute dtype, and a
    state dict taken then would hold them in place of the fp32 shards."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def parallelize_qwen35_moe(model: nn.Module, mesh: DeviceMesh | None, *, param_dtype: torch.dtype | None,
                           reduce_dtype: torch.dtype | None, ac_mode: str, compile: bool,
                           cp_mesh: DeviceMesh | None = None, ep_mesh: DeviceMesh | None = None,
                           expert_fsdp_mesh: DeviceMesh | None = None, expert_dispatch: str = "auto",
                           reshard_after_forward: bool = True, vocab_parallel: bool = False,
                           weight_copies: bool = False, grads_in_copies: bool = False,
                           train_mtp: bool = False) -> nn.Module:
    """`mesh`: the FSDP mesh (shard, or replicate x shard), None for a single process; `cp_mesh`: this rank's
    context-parallel group, None without context parallelism; `ep_mesh` / `expert_fsdp_mesh`: the expert-parallel
    group and the FSDP mesh of the experts' weights, None without expert parallelism; `expert_dispatch`: how
    tokens reach the experts' ranks ("auto", "all_gather" or "all_to_all", parallel/expert_parallel.py);
    `vocab_parallel`: the embedding and the lm_head vocabulary-parallel over the FSDP mesh (vocab_parallel.py).

    One rank (one GPU, or a single process) gets no FSDP: its weights stay whole fp32 parameters and, given a
    `param_dtype`, the model computes in it (one_device_precision.py), casting each weight where it is used, as
    FSDP's mixed precision would, without FSDP's copies and hooks; with `weight_copies` reading instead a copy of
    each weight in `param_dtype` that the optimizer rewrites as it updates the weight, which holds the weight's
    gradient too with `grads_in_copies` (one backward a step). `train_mtp`: the forward runs the MTP
    layers (their FSDP unit is gathered ahead, after the last block's). Returns the model, parallelized in place."""
    sharded = mesh is not None and mesh.size() > 1
    hooks = ParallelHooks(sharding=DTensorSharding(), gradients=StepGradients(ep_mesh.size() if ep_mesh else 1))
    if cp_mesh is not None:
        hooks.context_parallel = CPContext(cp_mesh)
    if ep_mesh is not None:
        hooks.expert_dispatch = shard_experts_for_dispatch(model, ep_mesh, expert_dispatch)
    # Compile first, then checkpoint the compiled block: compile over a checkpointed block would have to trace the
    # checkpoint whole, and a block with graph breaks (FLA's kernels, EP's exchange) cannot be; dynamo then runs
    # the whole block eagerly, in the forward and in the recompute. Full AC compiles the blocks itself, in two
    # halves (activation_checkpointing.py).
    runners = [layer.runner for layer in model.blocks()]
    if compile and ac_mode != "full":
        # apply_fsdp makes the first block's experts a unit of their own where FSDP runs without EP's expert mesh
        runners = compiled_runners(len(runners), first_block_own_frames=sharded and expert_fsdp_mesh is None)
    hooks.block_runners = checkpointed_runners(runners, ac_mode, compiled=compile)
    vocab_params = []
    if sharded and vocab_parallel:
        hooks.vocab_parallel = shard_vocab_rows(model, mesh, param_dtype)
        vocab_params = hooks.vocab_parallel.params
    if not sharded and param_dtype is not None:  # one rank: nothing to shard, the weights stay fp32 parameters
        hooks.mixed_precision = OneDevicePrecision(param_dtype, kept_copies=weight_copies,
                                                   grads_in_copies=grads_in_copies)
    model.set_parallel_hooks(hooks)
    if sharded:
        apply_fsdp(model, mesh, param_dtype, reduce_dtype, expert_fsdp_mesh, reshard_after_forward, vocab_params,
                   train_mtp=train_mtp)
    return model
