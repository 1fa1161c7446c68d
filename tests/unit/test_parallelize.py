"""Activation checkpointing changes memory, not math, and not the checkpoint keys."""

import copy

import pytest
import torch
import torch.nn.functional as F

from models.qwen35_moe import get_flavor
from parallel.parallelize import apply_activation_checkpointing
from tests.builders import initialized_model


def _model():
    return initialized_model(get_flavor("debugmodel"))


def _loss_and_grads(model, ids, positions):
    out = model(ids, positions)
    loss = F.cross_entropy(out.logits.flatten(0, 1), ids.roll(-1, dims=1).flatten()) + 0.01 * out.aux_loss
    loss.backward()
    # named_parameters (unlike state_dict) shows the wrapper's `_checkpoint_wrapped_module.` level.
    return loss.item(), {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_loss_grads_and_keys(mode):
    plain = _model()
    wrapped = copy.deepcopy(plain)
    apply_activation_checkpointing(wrapped, mode)
    assert list(wrapped.state_dict()) == list(plain.state_dict())

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (2, 96), generator=g)
    positions = torch.cat((torch.arange(40), torch.arange(56))).expand(2, 96)
    loss_a, grads_a = _loss_and_grads(plain, ids, positions)
    loss_b, grads_b = _loss_and_grads(wrapped, ids, positions)
    # The recomputed forward is the same fp32 CPU computation: equal up to summation order.
    assert loss_b == pytest.approx(loss_a, rel=1e-6)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-5, atol=1e-7, msg=name)
