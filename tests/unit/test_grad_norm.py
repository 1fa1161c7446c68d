"""Gradient clipping (parallel/grad_norm.py) against torch's clip_grad_norm_ on plain tensors; clipping folded into a fused AdamW step (parallel/grad_norm.py) against clipping the gradients in
place and stepping: the same weights. torch's fused AdamW runs on CPU too, so this runs in CI; eps is large so
that Adam's update depends on the gradients' scale (with a small eps it nearly does not, and a scale the step
ignored would go unseen: the test checks that clipping changes the result)."""

from __future__ import annotations

import pytest
import torch

from parallel.grad_norm import clip_grad_norm_


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _model_with_grads() -> torch.nn.Module:
    model = _model()
    model(torch.randn(8, 16)).square().sum().backward()
    return model


@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("max_norm", [0.5, 1e6, float("inf")])
def test_clipping_equals_torch_clip_grad_norm(max_norm, foreach):
    ours, theirs = _model_with_grads(), _model_with_grads()
    norm = clip_grad_norm_(ours.parameters(), max_norm, foreach=foreach)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm, foreach=foreach)
    assert norm.item() == pytest.approx(want.item(), rel=1e-6) and norm.item() > 0.5
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


def _stepped(max_norm: float, fold: bool, steps: int = 2) -> tuple[list[torch.Tensor], list[float]]:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, eps=1.0, weight_decay=0.1, fused=True)
    norms = []
    for step in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 16, generator=torch.Generator().manual_seed(step))).square().sum().backward()
        norms.append(clip_grad_norm_(model.parameters(), max_norm, scaling_optimizer=optimizer if fold else None).item())
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], norms


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clipping_folded_into_the_fused_step_equals_clipping_in_place(max_norm):
    folded, folded_norms = _stepped(max_norm, fold=True)
    in_place, in_place_norms = _stepped(max_norm, fold=False)
    assert folded_norms == in_place_norms and min(folded_norms) > 0.5  # 0.5 clips both steps
    for a, b in zip(folded, in_place):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # grad / (1 / c) against grad * c: last bits
    unclipped, _ = _stepped(float("inf"), fold=True)
    changed = any(not torch.allclose(a, b) for a, b in zip(folded, unclipped))
    assert changed == (max_norm == 0.5)


def test_an_unclipped_step_drops_the_previous_steps_scale():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([p], fused=True)
    p.grad = torch.full((3,), 10.0)
    clip_grad_norm_([p], 1.0, scaling_optimizer=optimizer)
    assert optimizer.grad_scale is not None
    clip_grad_norm_([p], float("inf"), scaling_optimizer=optimizer)
    assert optimizer.grad_scale is None
