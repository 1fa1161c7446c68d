"""LR schedule values at the points that define it."""

import math

import pytest
import torch

from harness.optim.lr_schedule import build_lr_scheduler, lr_factor


def test_warmup_is_linear_and_never_zero():
    assert [lr_factor(s, 100, 4, None, "linear", 0.0) for s in (1, 2, 3, 4)] == [0.2, 0.4, 0.6, 0.8]


def test_cosine_decay_over_all_steps_after_warmup():
    f = lambda s: lr_factor(s, 12, 2, None, "cosine", 0.1)
    assert f(2) == pytest.approx(2 / 3)
    assert f(7) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))  # halfway
    assert f(12) == pytest.approx(0.1)  # ends at min_lr_factor


def test_linear_and_sqrt_decay_shapes():
    assert lr_factor(6, 10, 0, None, "linear", 0.0) == pytest.approx(0.4)
    assert lr_factor(4, 16, 0, None, "sqrt", 0.0) == pytest.approx(0.5)


def test_warmup_stable_decay():
    f = lambda s: lr_factor(s, 100, 10, 0.2, "linear", 0.0)
    assert f(11) == 1.0 and f(80) == 1.0  # stable phase
    assert f(90) == pytest.approx(0.5) and f(100) == pytest.approx(0.0)


def test_scheduler_sets_optimizer_lr_per_update():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = build_lr_scheduler(opt, total_steps=5, warmup_steps=1, decay_ratio=None, decay_type="linear",
                               min_lr_factor=0.0)
    seen = []
    for _ in range(5):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.5, 0.75, 0.5, 0.25, 0.0])


def test_the_warmup_ramp_does_not_depend_on_the_run_length():
    """A run shorter than its warmup ramps as the longer run it may be resumed into (training.steps raised): the lr
    goes on from where it stopped instead of jumping back down the ramp."""
    short = [lr_factor(s, 10, 50, None, "cosine", 0.1) for s in range(1, 11)]
    long = [lr_factor(s, 100, 50, None, "cosine", 0.1) for s in range(1, 11)]
    assert short == long == pytest.approx([s / 51 for s in range(1, 11)])


def test_a_warmup_longer_than_the_run_is_named_in_a_warning(caplog):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with caplog.at_level("WARNING", logger="harness.optim.lr_schedule"):
        build_lr_scheduler(opt, total_steps=10, warmup_steps=10, decay_ratio=None, decay_type="cosine",
                           min_lr_factor=0.1)
        assert caplog.records == []  # a run that ends its warmup at its last step reaches ~the peak
        build_lr_scheduler(opt, total_steps=10, warmup_steps=50, decay_ratio=None, decay_type="cosine",
                           min_lr_factor=0.1)
    assert [r.getMessage() for r in caplog.records] == [
        "lr_scheduler.warmup_steps = 50 is longer than the run (training.steps = 10): the lr ramps up for the whole "
        "run and ends at 20% of optimizer.lr (10/51); lower warmup_steps to reach the peak"]
