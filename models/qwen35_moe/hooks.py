"""Where parallelism enters the model: the extension points it declares, their single-device defaults, and the one
object that sets them all (`ParallelHooks`, given to `Qwen35MoeModel.set_parallel_hooks` by the parallelize
function, parallel/parallelize.py).

| extension point | declared on | single device | set by parallel/ |
|---|---|---|---|
| `context_parallel: ContextParallel` | the model, each mixer | None: the rows are whole | `CPContext` (context_parallel.py) |
| `dispatch: ExpertDispatch` | each SparseMoE | None: the local experts | all-gather / all-to-all (expert_parallel.py) |
| `sharding: ParamSharding` | the model, each RoutedExperts | `UNSHARDED` | `DTensorSharding` (parallelize.py) |
| `vocab_parallel: VocabParallel` | the embedding, the lm_head | None: the whole table | `VocabShard` (vocab_parallel.py) |
| `runner: BlockRunner` | each DecoderLayer | `run_block`: plain | compile / AC (compile.py, activation_checkpointing.py) |
| `mixed_precision: MixedPrecision` | the model | None: the weights' dtype | `OneDevicePrecision` (one_device_precision.py) |
| `weight_reader: WeightReader`, from it | each Linear, RoutedExperts | None: cast where used | `KeptCopies` (one_device_precision.py) |
| `gradients: GradientStep` | the model | None: no training step | `StepGradients` (step_gradients.py) |

The wrappers parallelism puts around a block (activation checkpointing, compile, FSDP) insert a level into the names
of its parameters, never into state-dict keys: `canonical_name` takes them out, for whatever names parameters by
their key (initial values, checkpoints, exports).

One more extension point is not parallelism's: `adapter`, declared on each Linear, TopKRouter and RoutedExperts
(None: the plain module), where LoRA puts its trained low-rank update beside a frozen weight (lora.py).

The model imports nothing from torch.distributed: the protocols below say what it calls, parallel/ implements them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from .documents import DocumentLayout

# The levels those wrappers insert into parameter names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """The state-dict key of a parameter name (activation checkpointing and compile wrappers removed)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


class ContextParallel(Protocol):
    """One context-parallel group: this rank holds its zigzag share of every row (docs/design.md, "Parallelism")."""

    rank: int
    size: int

    def gather_sequence(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """(..., S/cp, ...) this rank's zigzag tokens -> (..., S, ...) the whole rows in natural order."""

    def scatter_sequence(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """(..., S, ...) partial sums in natural order -> this rank's zigzag tokens of their sum over the group."""

    def local_layout(self, position_ids: torch.Tensor) -> DocumentLayout:
        """The document layout of this rank's share of the rows, given its (B, S/cp) position ids."""


class ExpertDispatch(Protocol):
    """How a MoE layer's routed tokens reach their experts and come back."""

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor,
               experts: torch.nn.Module) -> torch.Tensor:
        """x (N, D), top-k weights and expert ids (N, k), counts (E,) -> (N, D), each token's weighted sum of its
        experts' outputs."""


class ParamSharding(Protocol):
    """How a parameter relates to this rank's tensor of it."""

    def local(self, param: torch.Tensor) -> torch.Tensor:
        """The tensor this rank holds of `param` (e.g. its experts under expert parallelism)."""

    def local_part(self, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of `full`, a whole tensor of `param`'s global shape."""


class VocabParallel(Protocol):
    """The embedding and the lm_head sharded by vocabulary rows: the tokens travel, the weights stay."""

    def embed(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """ids (...) -> (..., hidden) rows of the sharded table."""

    def local(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a sharded weight."""

    def full(self, weight: torch.Tensor) -> torch.Tensor:
        """The whole weight (gathered; evaluation's logits only)."""


class WeightReader(Protocol):
    """How a module reads its weights in the dtype it computes in, where that is not their own dtype."""

    def read(self, module: nn.Module, name: str, dtype: torch.dtype) -> torch.Tensor:
        """`module`'s weight `name` in `dtype`; the gradient reaches the weight (or whatever holds it for the
        optimizer)."""


class MixedPrecision(Protocol):
    """The weights stay in their own dtype (fp32) while the blocks compute in `dtype`, where no FSDP policy casts them
    (one GPU). Set on the model; each Linear and RoutedExperts reads its weights through `reader(module)`."""

    dtype: torch.dtype  # the embedding's rows are cast to it; every module then computes in its input's dtype

    def before_forward(self) -> None:
        """Called as each forward of the model starts."""

    def reader(self, module: nn.Module) -> WeightReader | None:
        """What `module` reads its weights through; None: it casts them where it uses them."""


BlockRunner = Callable[[torch.nn.Module, torch.Tensor, "DocumentLayout"], tuple]
"""(layer, h, layout) -> the DecoderLayer's outputs, running the block (its mixer and MoE halves) as it
chooses: plainly, compiled, checkpointed."""


class _Unsharded:
    """Every parameter is whole on this rank."""

    def local(self, param: torch.Tensor) -> torch.Tensor:
        return param

    def local_part(self, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        return full


UNSHARDED: ParamSharding = _Unsharded()


class GradientStep(Protocol):
    """What a training step does with the model's gradients once its backward is done, before the optimizer reads
    them: parallelism's own scaling (expert parallelism's), then the clipping of the gradients it placed (weight
    copies included) to their global norm."""

    def finish(self, model: nn.Module, max_norm: float, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Scale and clip the gradients (max_norm inf: none clipped); returns their norm before clipping, on the
        device. `optimizer` may apply the clipping itself as it reads them."""
        ...


@dataclass
class ParallelHooks:
    """Everything the parallelize function sets in the model, in one call (`Qwen35MoeModel.set_parallel_hooks`).
    A field left at its default keeps the single-device behaviour."""

    context_parallel: ContextParallel | None = None
    # One dispatch per MoE layer (the all-to-all keeps its layer's split sizes for the checkpointing recompute).
    expert_dispatch: Callable[[torch.nn.Module], ExpertDispatch] | None = None
    sharding: ParamSharding = UNSHARDED
    vocab_parallel: VocabParallel | None = None
    # Per block index (`Qwen35MoeModel.blocks()`: the main stack's, then the MTP layers'): how that block runs
    # (compiled, checkpointed).
    block_runners: list[BlockRunner] | None = None
    mixed_precision: MixedPrecision | None = None
    gradients: GradientStep | None = None
