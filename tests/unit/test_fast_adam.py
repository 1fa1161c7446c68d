"""FastAdam's torch-ops step (harness/optim/fast_adam.py: every tensor its Triton kernel does not take: off CUDA, not
fp32, not contiguous) against torch's single-tensor Adam and AdamW: bit for bit, with a transposed (non-contiguous)
parameter, decay and no-decay groups, and a gradient scale equal to dividing the gradients first. Its CUDA kernel
is tested against a float64 Adam in tests/gpu/test_fast_adam.py."""

from __future__ import annotations

import pytest
import torch

from harness.optim.fast_adam import FastAdam


def _run(make, scale: float | None = None, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4)),
              torch.nn.Parameter(torch.randn(6, 7).t())]  # non-contiguous
    assert not params[2].is_contiguous()
    optimizer = make([{"params": params[::2], "weight_decay": 0.1}, {"params": params[1:2], "weight_decay": 0.0}])
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p)
            if scale is not None and not isinstance(optimizer, FastAdam):
                p.grad /= scale  # what the scale stands for: gradients divided before the step
        if isinstance(optimizer, FastAdam) and scale is not None:
            optimizer.grad_scale = torch.tensor(scale)
        optimizer.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize("scale", [None, 4.0])
@pytest.mark.parametrize("decoupled", [True, False])
def test_torch_ops_step_is_torchs_single_tensor_adam(decoupled, scale):
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ours = _run(lambda groups: FastAdam(groups, decoupled_weight_decay=decoupled, **kwargs), scale)
    theirs = _run(lambda groups: (torch.optim.AdamW if decoupled else torch.optim.Adam)(
        groups, foreach=False, **kwargs), scale)
    start = _run(lambda groups: torch.optim.SGD(groups, lr=0.0), steps=1)
    for a, b, p0 in zip(ours, theirs, start):
        assert not torch.equal(a, p0)
        torch.testing.assert_close(a, b, rtol=0, atol=0)
