"""Gated full attention: GQA with per-head q/k RMSNorm, partial RoPE and a sigmoid output gate.

Kernels: flash varlen for packed rows on CUDA in half precision; SDPA otherwise (causal, or a block-diagonal
causal mask for packed rows). Under context parallelism (`context_parallel`, hooks.py) the layer
all-gathers the whole rows' keys and values (2 KV heads: cheap; backward reduce-scatters their gradients) and runs
its local queries against them: flash varlen over (chunk, document) segments on CUDA, SDPA with the mask of the
queries' places in the row otherwise.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from .args import Qwen35MoeArgs
from .documents import DocumentLayout, context_parallel_segments
from .hooks import ContextParallel, ParallelHooks
from .linear import Linear
from .norms import ZeroCenteredRMSNorm
from .rope import apply_rope, rope_cos_sin


@functools.cache
def _varlen_attn():
    """(torch's flash varlen attention, whether it takes enable_gqa), or (None, False) on a torch without it.
    Looked up once: it runs in every attention layer's forward."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def _sdpa(q, k, v, layout: DocumentLayout) -> torch.Tensor:
    """q (B, Hq, S, D), k/v (B, Hkv, S, D) -> (B, Hq, S, D); causal within each document."""
    # GQA: each kv head serves a contiguous group of query heads (enable_gqa = repeat_interleave).
    gqa = k.shape[1] != q.shape[1]
    if not layout.is_packed:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    doc = layout.document_ids
    seq = doc.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    mask = (doc.unsqueeze(2) == doc.unsqueeze(1)) & causal  # (B, S, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=gqa)


def _sdpa_context_parallel(q, k, v, layout: DocumentLayout) -> torch.Tensor:
    """Local queries q (B, Hq, S_local, D) against the whole rows' keys and values k/v (B, Hkv, S, D) -> (B, Hq,
    S_local, D): a query attends to the keys at or before its place in the row, within its document."""
    whole, index = layout.global_layout, layout.token_index
    seq = k.shape[2]
    mask = torch.arange(seq, device=q.device) <= index.unsqueeze(1)  # (S_local, S) causal by row position
    if whole.is_packed:
        doc = whole.document_ids  # (B, S)
        mask = mask & (doc[:, index].unsqueeze(2) == doc.unsqueeze(1))  # (B, S_local, S)
    mask = mask.expand(q.shape[0], -1, -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), enable_gqa=k.shape[1] != q.shape[1])


def _varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int) -> torch.Tensor:
    """Flattened q (Tq, Hq, D), k/v (Tk, Hkv, D) -> (Tq, Hq, D): causal within each segment, aligned to the bottom
    right when a segment has more keys than queries."""
    varlen_attn, takes_gqa = _varlen_attn()
    kwargs = {}
    if k.shape[1] != q.shape[1]:
        if takes_gqa:
            kwargs["enable_gqa"] = True
        else:
            repeats = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(-1, 0), **kwargs)


# The two flash paths below run outside torch.compile's graph (compile.enable): they hand the layout's Python ints
# (the longest document or segment) to the kernel, and traced, each new longest document of a batch would
# recompile the block; after 8 dynamo gives up and runs the block eagerly for the rest of the run.
@torch.compiler.disable
def _flash_varlen(q, k, v, layout: DocumentLayout) -> torch.Tensor:
    """Packed documents on CUDA in half precision: flash varlen, no (S, S) mask is materialised."""
    batch, seq = q.shape[0], q.shape[1]
    q, k, v = (t.reshape(batch * seq, t.shape[2], t.shape[3]) for t in (q, k, v))  # (B*S, H, D)
    cu = layout.cu_seqlens
    out = _varlen(q, k, v, cu, cu, layout.max_seqlen, layout.max_seqlen)
    return out.reshape(batch, seq, out.shape[1], out.shape[2])


@torch.compiler.disable
def _flash_varlen_context_parallel(q, k, v, layout: DocumentLayout) -> torch.Tensor:
    """Local queries q (B, S_local, Hq, D) against the whole rows' k/v (B, S, Hkv, D) on CUDA in half precision:
    each (chunk, document) segment of queries against its document's keys up to its last query. The gathered
    keys are about S_local * 1.5 tokens for one long document (2 heads of 256 for 35B-A3B): no mask is built."""
    if layout.cp_segments is None:
        layout.cp_segments = context_parallel_segments(layout)
    seg = layout.cp_segments
    batch, local = q.shape[0], q.shape[1]
    k, v = (t.reshape(-1, t.shape[2], t.shape[3]).index_select(0, seg.key_index) for t in (k, v))
    out = _varlen(q.reshape(batch * local, q.shape[2], q.shape[3]), k, v, seg.cu_seqlens_q, seg.cu_seqlens_k,
                  seg.max_seqlen_q, seg.max_seqlen_k)
    return out.reshape(batch, local, out.shape[1], out.shape[2])


def _flash_applies(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _varlen_attn()[0] is not None


class GatedAttention(nn.Module):
    def __init__(self, args: Qwen35MoeArgs):
        super().__init__()
        self.num_heads = args.num_attention_heads
        self.num_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        bias = args.attention_bias
        # q_proj yields, per head, the query followed by its output gate: (H, 2 * D).
        self.q_proj = Linear(args.hidden_size, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = Linear(args.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(args.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, args.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.rotary_dim, self.rope_theta = args.rotary_dim, args.rope_theta
        self.context_parallel: ContextParallel | None = None  # the CP group's exchanges (hooks.py)

    def set_parallel_hooks(self, hooks: ParallelHooks) -> None:
        """This layer's extension point (hooks.py): the CP group's exchanges."""
        self.context_parallel = hooks.context_parallel

    def forward(self, x: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        return self.project(self.core(x, layout))

    def project(self, out: torch.Tensor) -> torch.Tensor:
        return self.o_proj(out)

    def core(self, x: torch.Tensor, layout: DocumentLayout) -> torch.Tensor:
        """The layer up to its output projection: the heads' gated outputs (B, S, H * D)."""
        batch, seq, _ = x.shape
        q, gate = self.q_proj(x).view(batch, seq, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        gate = gate.reshape(batch, seq, self.num_heads * self.head_dim)
        q = self.q_norm(q)  # (B, S, Hq, D)
        k = self.k_norm(self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        # fp32 angles from integer positions, here rather than passed in: FSDP would cast them to bf16.
        cos, sin = rope_cos_sin(layout.position_ids, self.rotary_dim, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        cp = self.context_parallel
        if cp is not None:  # this rank's queries against the whole rows' keys and values
            k, v = cp.gather_sequence(k), cp.gather_sequence(v)  # (B, S, Hkv, D), natural order
            if _flash_applies(q):
                out = _flash_varlen_context_parallel(q, k, v, layout)
            else:
                out = _sdpa_context_parallel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout)
                out = out.transpose(1, 2)
        elif layout.is_packed and _flash_applies(q):
            out = _flash_varlen(q, k, v, layout)  # (B, S, Hq, D)
        else:
            out = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout).transpose(1, 2)
        return out.reshape(batch, seq, self.num_heads * self.head_dim) * torch.sigmoid(gate)
