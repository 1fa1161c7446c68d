"""FLA 0.6's chunked gated delta rule, its own kernels in its own order, with the chunk states kept for the backward.

FLA's autograd function saves only q, k, v, g, beta and the chunks' triangular factors A; its backward then
reruns two forward kernels to rebuild the WY factors w, u (`recompute_w_u_fwd`) and the states h at every chunk
boundary with the corrected values v_new (`chunk_gated_delta_rule_fwd_h`). This function saves w, h and v_new from
the forward instead (the backward reads nothing else of them): per token and value head 2 * (Dk + Dv) bytes plus
the state h, 2 * Dk * Dv bytes per 64-token chunk - 270 MB per layer of 8192 tokens and 32 heads of 128, while
the layer's activations are saved; the step is faster for that memory (docs/performance.md, "Tried, not kept":
FLA's own backward). Under activation checkpointing the forward is rerun anyway, and they are made there.

The calls and their arguments are FLA 0.6.0's `chunk_gated_delta_rule_fwd` / `_bwd` (fla/ops/gated_delta_rule/
chunk.py) without the options we never pass (initial or final state, FLA's context parallel, in-kernel gate or
beta activation), so outputs and gradients are bitwise FLA's own (tests/gpu/test_fla_kernels.py).
"""

from __future__ import annotations

import torch

from .fla_varlen import FLA_CHUNK_SIZE as CHUNK


class SavedStatesGatedDeltaRule(torch.autograd.Function):
    """o = chunk_gated_delta_rule(q, k, v, g, beta, scale) for q, k already L2-normalised and repeated for the value
    heads (B, T, H, K), v (B, T, H, V), g (B, T, H) log decays in fp32, beta (B, T, H); varlen through cu_seqlens
    and FLA's chunk index. Returns o in q's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale: float, cu_seqlens, chunk_indices):
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2

        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))  # as FLA's input_guard
        varlen = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        with torch.cuda.device(q.device.index):
            g = chunk_local_cumsum(g, chunk_size=CHUNK, scale=RCP_LN2, **varlen)
            w, u, A = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, chunk_size=CHUNK, **varlen)
            h, v_new, _ = chunk_gated_delta_rule_fwd_h(k=k, w=w, u=u, g=g, initial_state=None,
                                                       output_final_state=False, chunk_size=CHUNK, **varlen)
            o = chunk_fwd_o(q=q, k=k, v=v_new, h=h, g=g, scale=scale, chunk_size=CHUNK, **varlen)
        ctx.save_for_backward(q, k, v, g, beta, A, w, h, v_new, cu_seqlens, chunk_indices)
        ctx.scale = scale
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_bwd_dhu
        from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv_local
        from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd
        from fla.ops.utils import chunk_local_cumsum

        q, k, v, g, beta, A, w, h, v_new, cu_seqlens, chunk_indices = ctx.saved_tensors
        scale, do = ctx.scale, do.contiguous()
        varlen = dict(cu_seqlens=cu_seqlens, chunk_indices=chunk_indices)
        with torch.cuda.device(q.device.index):
            dv = chunk_bwd_dv_local(q=q, k=k, g=g, do=do, scale=scale, chunk_size=CHUNK, **varlen)
            dh, _, dv = chunk_gated_delta_rule_bwd_dhu(q=q, k=k, w=w, g=g, h0=None, dht=None, do=do, dv=dv,
                                                       scale=scale, chunk_size=CHUNK, **varlen)
            dq, dk, dw, dg = chunk_bwd_dqkwg(q=q, k=k, v=v_new, w=w, g=g, h=h, dv=dv, do=do, dh=dh, scale=scale,
                                             chunk_size=CHUNK, **varlen)
            dk2, dv, db, dg2 = prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=g, A=A, dw=dw, du=dv, **varlen)
            dk.add_(dk2)
            dg.add_(dg2)
            dg = chunk_local_cumsum(dg, chunk_size=CHUNK, reverse=True, **varlen)
        return dq.to(q), dk.to(k), dv.to(v), dg.to(g), db.to(beta), None, None, None
