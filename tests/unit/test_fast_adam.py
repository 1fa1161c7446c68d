"""FastAdam off CUDA (harness/fast_adam.py) is torch's Adam/AdamW step on its own groups and state; its CUDA kernel
is tested against torch's fused step in tests/gpu/test_fast_adam.py."""

from __future__ import annotations

import pytest
import torch

from harness.fast_adam import FastAdam


@pytest.mark.parametrize("decoupled", [True, False])
def test_cpu_step_is_torchs(decoupled):
    def run(make):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
        optimizer = make([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}])
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            optimizer.step()
        return params

    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ours = run(lambda groups: FastAdam(groups, decoupled_weight_decay=decoupled, **kwargs))
    theirs = run(lambda groups: (torch.optim.AdamW if decoupled else torch.optim.Adam)(groups, **kwargs))
    start = run(lambda groups: torch.optim.SGD(groups, lr=0.0))
    for a, b, p0 in zip(ours, theirs, start):
        assert not torch.equal(a, p0)
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cpu_step_refuses_a_gradient_scale():
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    optimizer = FastAdam([p], lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    optimizer.grad_scale = torch.tensor(2.0)
    with pytest.raises(ValueError, match="grad_scale"):
        optimizer.step()
