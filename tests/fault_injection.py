"""Kernels with a known, small defect: what the FLA self-check must catch."""

import torch

from models.qwen35_moe.kernels.gated_delta_rule import gated_delta_rule


class _ScaleHeadGradient(torch.autograd.Function):
    """Identity forward; backward scales the gradient of one head (dim 2) by `factor`."""

    @staticmethod
    def forward(ctx, x, head, factor):
        ctx.head, ctx.factor = head, factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad[:, :, ctx.head] *= ctx.factor
        return grad, None, None


def kernel_with_wrong_dg(head: int = 1, factor: float = 1.01, kernel=gated_delta_rule):
    """`kernel` (FLA's by default) whose gradient w.r.t. g is off by `factor` in one value head."""

    def wrong(q, k, v, g, beta, cu_seqlens=None):
        return kernel(q, k, v, _ScaleHeadGradient.apply(g, head, factor), beta, cu_seqlens=cu_seqlens)

    return wrong
