"""Qwen3.5-MoE causal language model: a hybrid stack of Gated DeltaNet and gated full attention layers,
each followed by a sparse MoE block.

Build it on the meta device, then materialise and initialise it explicitly (ready for FSDP):

    with torch.device("meta"):
        model = Qwen35MoeModel(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)

Parallelism enters only through the extension points listed in hooks.py, set in one call
(`set_parallel_hooks`); alone, the model is the plain single-device model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .args import FULL_ATTENTION, Qwen35MoeArgs
from .attention import GatedAttention
from .documents import DocumentLayout, document_layout
from .gated_deltanet import CPAwareGatedDeltaNet
from .hooks import (
    UNSHARDED,
    BlockRunner,
    ContextParallel,
    GradientStep,
    MixedPrecision,
    ParallelHooks,
    ParamSharding,
    VocabParallel,
)
from .init import init_weights
from .kernels.linear_cross_entropy import CHUNK_TOKENS, linear_cross_entropy_sum
from .linear import Linear
from .moe import RoutedExperts, RouterStats, SparseMoE, load_balancing_loss
from .mtp import MultiTokenPredictor, shifted_ids
from .norms import ZeroCenteredRMSNorm


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None  # (B, S, vocab); None when the forward was given labels
    # Routing statistics of every MoE layer (counts and probability sums, each (layers, experts)); a trainer
    # pools them over data-parallel ranks for a balance loss that does not depend on how the batch is split.
    router_stats: RouterStats
    # With labels: the cross entropy summed over the label tokens (fp32) times the forward's `ce_weight`, computed
    # chunk by chunk without the whole logits (kernels/linear_cross_entropy.py).
    ce_sum: torch.Tensor | None = None
    # With `mtp=True`: per MTP depth k, its normed hidden states (B, S, D), which the shared lm_head maps to logits of
    # x_{t+k+2} (mtp.py), and the MTP layers' routing statistics (not part of `router_stats`).
    mtp_hidden: list[torch.Tensor] | None = None
    mtp_router_stats: RouterStats | None = None
    # With `mtp=True` and MTP labels: the MTP depths' cross entropies, each summed over its label tokens and times
    # that depth's `mtp_ce_weights` entry, summed over the depths.
    mtp_ce_sum: torch.Tensor | None = None
    # With `return_hidden=True`: the final-normed hidden states (B, S, D) the lm_head reads.
    hidden: torch.Tensor | None = None

    @property
    def aux_loss(self) -> torch.Tensor:
        """MoE load-balancing loss of this forward's tokens, averaged over layers (unscaled by its coefficient)."""
        return load_balancing_loss(self.router_stats)


class Embedding(nn.Embedding):
    """nn.Embedding, or the vocabulary-parallel lookup once its table is sharded by rows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.vocab_parallel: VocabParallel | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_parallel is not None:
            return self.vocab_parallel.embed(ids, self.weight)
        return super().forward(ids)


class LMHead(Linear):
    """The output projection: logits, or given labels the summed cross entropy without them. The loss runs inside
    this module's call so that FSDP's hooks, which gather the weight before it and reduce its gradient after, frame
    it: the head is an FSDP unit of its own (parallel/parallelize.py). Vocabulary-parallel, the weight is this
    rank's rows and the loss exchanges per-row statistics with the other ranks (kernels/linear_cross_entropy.py)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.vocab_parallel: VocabParallel | None = None

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None, chunk_tokens: int = CHUNK_TOKENS,
                ce_weight: torch.Tensor | None = None,
                more: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], ...] = ()):
        """h (N, D) -> logits (N, vocab), or given labels (N,) the summed cross entropy times `ce_weight`.
        `more`: further (h, labels, ce_weight) whose sums are computed in the same call (the MTP depths'): under FSDP
        the weight is then gathered once and its gradient reduced once. With `more`, returns the list of sums."""
        vocab = self.vocab_parallel
        if labels is None:
            return super().forward(h) if vocab is None else F.linear(h, vocab.full(self.weight).to(h.dtype))
        if more:
            return [self._ce_sum(*args, chunk_tokens) for args in ((h, labels, ce_weight), *more)]
        return self._ce_sum(h, labels, ce_weight, chunk_tokens)

    def _ce_sum(self, h: torch.Tensor, labels: torch.Tensor, ce_weight: torch.Tensor | None,
                chunk_tokens: int) -> torch.Tensor:
        vocab = self.vocab_parallel
        if vocab is not None:
            total = linear_cross_entropy_sum(h, vocab.local(self.weight), labels, chunk_tokens, vocab=vocab)
            return total if ce_weight is None else total * ce_weight
        with torch.no_grad():  # the loss computes the weight's gradient itself, for self.weight
            weight_in_h_dtype = self.weight_as(h.dtype)
        return linear_cross_entropy_sum(h, self.weight, labels, chunk_tokens, scale=ce_weight,
                                        weight_in_h_dtype=weight_in_h_dtype)


def run_block(layer: DecoderLayer, h: torch.Tensor, layout: DocumentLayout):
    """A DecoderLayer's forward as written (the default `runner`): the mixer with its residual, then the MoE with
    its. Spelled out rather than through the halves' methods: under compile each function that a graph break (FLA's
    call; on CPU and under EP also the experts') passes through becomes frames that dynamo compiles separately."""
    h = h + layer.mixer(layer.input_layernorm(h), layout)
    moe_out, counts, prob_sums = layer.mlp(layer.post_attention_layernorm(h))
    return h + moe_out, counts, prob_sums


class DecoderLayer(nn.Module):
    def __init__(self, args: Qwen35MoeArgs, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = ZeroCenteredRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        if layer_type == FULL_ATTENTION:
            self.self_attn = GatedAttention(args)
        else:
            self.linear_attn = CPAwareGatedDeltaNet(args)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = SparseMoE(args)
        # How the two halves run: as written, or compiled and/or checkpointed (parallel/compile.py,
        # parallel/activation_checkpointing.py). A runner keeps the parameters, and so the state dict, untouched.
        self.runner: BlockRunner = run_block

    def forward(self, h: torch.Tensor, layout: DocumentLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h (B, S, D) -> h (B, S, D), this layer's expert counts (E,) and router probability sums (E,)."""
        return self.runner(self, h, layout)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn if self.layer_type == FULL_ATTENTION else self.linear_attn

    # The halves as methods, for activation checkpointing to treat them differently (parallel/
    # activation_checkpointing.py calls the mixer's `core` and `project` apart: hooks on the mixer module itself do
    # not run then).
    def mixer_core(self, h: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        """The token mixer of norm(h) up to its output projection."""
        return self.mixer.core(self.input_layernorm(h), layout)

    def moe_half(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The MoE with its residual: h + moe(norm(h)), with the routing statistics."""
        moe_out, counts, prob_sums = self.mlp(self.post_attention_layernorm(h))
        return h + moe_out, counts, prob_sums


class Qwen35MoeModel(nn.Module):
    def __init__(self, args: Qwen35MoeArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size)
        # A dict keyed by layer index keeps checkpoint keys stable when pipeline stages drop layers.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(args, t) for i, t in enumerate(args.layer_types)})
        self.norm = ZeroCenteredRMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.lm_head = LMHead(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # The multi-token-prediction layers of the released checkpoints (mtp.py); run only when a forward asks.
        self.mtp = None
        if args.mtp_num_hidden_layers:
            layers = [DecoderLayer(args, FULL_ATTENTION) for _ in range(args.mtp_num_hidden_layers)]
            self.mtp = MultiTokenPredictor(args, layers)
        # The extension points of hooks.py, at their single-device defaults (set_parallel_hooks):
        self.context_parallel: ContextParallel | None = None  # this rank holds a zigzag share of every row
        self.sharding: ParamSharding = UNSHARDED  # how a sharded parameter maps to this rank's tensor (init)
        # The blocks compute in its dtype while the weights keep theirs (one GPU): the embedding's rows are cast to
        # it, every module then follows its input (linear.py). None: the weights' dtype.
        self.mixed_precision: MixedPrecision | None = None
        # What a training step does with the gradients after the backward (set by the parallelize function).
        self.gradients: GradientStep | None = None

    def set_parallel_hooks(self, hooks: ParallelHooks) -> None:
        """Set every extension point of the model and its modules from `hooks` (hooks.py), in one call."""
        self.context_parallel, self.sharding = hooks.context_parallel, hooks.sharding
        self.mixed_precision = precision = hooks.mixed_precision
        self.gradients = hooks.gradients
        self.embed_tokens.vocab_parallel = self.lm_head.vocab_parallel = hooks.vocab_parallel
        for index, layer in enumerate(self.blocks()):
            layer.mixer.set_parallel_hooks(hooks)
            layer.mlp.set_parallel_hooks(hooks)
            layer.runner = run_block if hooks.block_runners is None else hooks.block_runners[index]
        for module in self.modules():
            if isinstance(module, (Linear, RoutedExperts)):
                module.weight_reader = None if precision is None else precision.reader(module)

    def blocks(self) -> list[DecoderLayer]:
        """Every decoder block: the main stack's, then the MTP layers' (`ParallelHooks.block_runners` order)."""
        return [*self.layers.values(), *(self.mtp.layers.values() if self.mtp is not None else ())]

    def _apply(self, fn, recurse=True):
        # `to_empty`, `.to()` and the like give each module a new Parameter for every tensor they convert (a tensor
        # on the meta device cannot be converted in place), so the two modules' shared one would come out as two:
        # a "tied" model built on meta trained two matrices and exported one.
        result = super()._apply(fn, recurse)
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        return result

    def init_weights(self, seed: int = 0) -> None:
        """HF-like init (rules in init.py), drawn per parameter from (seed, name): the same weights for the
        same seed whether the model is whole or sharded over any mesh."""
        init_weights(self, seed, self.args.initializer_range, self.sharding)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, loss_chunk_tokens: int = CHUNK_TOKENS,
                layout: DocumentLayout | None = None, ce_weight: torch.Tensor | None = None,
                mtp: bool = False, mtp_input_ids: torch.Tensor | None = None, mtp_labels: torch.Tensor | None = None,
                mtp_ce_weights: torch.Tensor | None = None, return_hidden: bool = False) -> CausalLMOutput:
        """input_ids (B, S); position_ids (B, S) restarting at 0 at each packed document (None: one
        document per row). Returns logits (B, S, vocab) and the MoE routing statistics; given labels (B, S;
        -100 ignored), the summed cross entropy instead of the logits, `loss_chunk_tokens` tokens at a time, times
        `ce_weight` if given: the weight of that sum in the loss a trainer minimises (its choice: the harness's is
        world size / the global batch's label tokens, harness/objective.py), an fp32 0-dim tensor known before the
        forward. The head computes the gradients in the same pass as the sum and applies the weight there, sparing a
        pass over its weight's gradient; backpropagate the result with gradient 1, as part of a sum.
        `layout`: the batch's document layout derived on the host (documents.py; under context parallelism by
        `context_parallel.local_layout`), in place of position_ids: spares the GPU the syncs of deriving it.
        Under context parallelism every tensor holds this rank's zigzag share of the rows.
        `mtp`: also run the multi-token-prediction layers (mtp.py) on the final-normed hidden states, on
        `mtp_input_ids` (B, S, depth), the tokens x_{t+k+1} of mtp.mtp_rows (derived from input_ids if None; required
        under context parallelism, where they must come from the whole rows). With labels, `mtp_labels` (B, S,
        depth; mtp.mtp_rows) gives the MTP cross entropy too, depth k's sum times `mtp_ce_weights[k]` (fp32, as
        `ce_weight`; None: unweighted). `return_hidden`: the output also holds the final-normed hidden states."""
        batch, seq = input_ids.shape
        if mtp and self.mtp is None:
            raise ValueError("mtp=True, but the model has no MTP layer (args.mtp_num_hidden_layers is 0)")
        if mtp and mtp_input_ids is None and self.context_parallel is not None:
            raise ValueError("MTP under context parallelism needs mtp_input_ids from the whole rows (mtp.mtp_rows): "
                             "the next token of a zigzag chunk's last one lies in another chunk")
        if mtp and labels is not None and mtp_labels is None:
            raise ValueError("mtp=True with labels needs mtp_labels (mtp.mtp_rows)")
        # Integer positions only cross module boundaries: FSDP casts floating inputs of every block to
        # its param dtype, so RoPE angles are computed in fp32 inside each attention layer.
        if layout is not None:
            if self.context_parallel is not None and layout.global_layout is None:
                raise ValueError("under context parallelism the layout must describe the whole rows "
                                 "(context_parallel.local_layout)")
            layout = layout.to(input_ids.device)
        elif self.context_parallel is None:
            layout = document_layout(position_ids, batch, seq, input_ids.device)
        elif position_ids is None:
            raise ValueError("under context parallelism position_ids are required (this rank's share of them)")
        else:
            layout = self.context_parallel.local_layout(position_ids)

        if self.mixed_precision is not None:
            self.mixed_precision.before_forward()
        h = self._embed(input_ids)
        counts, prob_sums = [], []
        for layer in self.layers.values():
            h, layer_counts, layer_prob_sums = layer(h, layout)
            counts.append(layer_counts)
            prob_sums.append(layer_prob_sums)
        stats = RouterStats(torch.stack(counts), torch.stack(prob_sums), num_tokens=batch * seq,
                            top_k=self.args.num_experts_per_tok)
        h = self.norm(h)
        extra = {"hidden": h} if return_hidden else {}
        if mtp:
            if mtp_input_ids is None:
                mtp_input_ids = shifted_ids(input_ids, len(self.mtp.layers))
            mtp_hidden, mtp_counts, mtp_prob_sums = self.mtp(h, mtp_input_ids, self._embed, layout)
            extra.update(mtp_hidden=mtp_hidden, mtp_router_stats=RouterStats(
                torch.stack(mtp_counts), torch.stack(mtp_prob_sums), num_tokens=batch * seq,
                top_k=self.args.num_experts_per_tok))
        if labels is None:
            return CausalLMOutput(logits=self.lm_head(h), router_stats=stats, **extra)
        if not mtp:
            ce_sum = self.lm_head(h.flatten(0, 1), labels.flatten(), loss_chunk_tokens, ce_weight=ce_weight)
            return CausalLMOutput(logits=None, router_stats=stats, ce_sum=ce_sum, **extra)
        # One call of the head for the main and the MTP losses (LMHead.forward's `more`)
        weights = [None] * len(mtp_hidden) if mtp_ce_weights is None else list(mtp_ce_weights.unbind())
        more = tuple((hk.flatten(0, 1), mtp_labels[..., k].flatten(), weights[k]) for k, hk in enumerate(mtp_hidden))
        ce_sum, *mtp_sums = self.lm_head(h.flatten(0, 1), labels.flatten(), loss_chunk_tokens, ce_weight=ce_weight,
                                         more=more)
        return CausalLMOutput(logits=None, router_stats=stats, ce_sum=ce_sum, mtp_ce_sum=sum(mtp_sums), **extra)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, S) ids -> (B, S, D) in the compute dtype."""
        h = self.embed_tokens(ids)  # rows looked up, then cast: the table's gradient is summed in its own dtype
        return h if self.mixed_precision is None else h.to(self.mixed_precision.dtype)
