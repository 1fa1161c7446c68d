"""Learning-rate schedule: linear warmup, optional constant phase, then decay to min_lr_factor * lr.

With `decay_ratio` None the decay spans every step after warmup (warmup + decay); with a ratio r the
last r * steps decay and the steps between warmup and decay hold the peak lr (warmup-stable-decay).
The warmup ramp is the same whatever the run's length: a run shorter than its warmup (named in a warning) ends
on the ramp, and a relaunch that raises training.steps goes on up the same ramp.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def lr_factor(step: int, total_steps: int, warmup_steps: int, decay_ratio: float | None, decay_type: str,
              min_lr_factor: float) -> float:
    """Multiplier of the peak lr at optimizer step `step` (1-based: the first update uses step 1)."""
    if step <= warmup_steps:
        return step / (warmup_steps + 1)  # never exactly 0: the first update already moves the weights
    decay_steps = total_steps - warmup_steps if decay_ratio is None else round(total_steps * decay_ratio)
    decay_start = total_steps - decay_steps
    if step <= decay_start or decay_steps <= 0:
        return 1.0
    progress = min((step - decay_start) / decay_steps, 1.0)
    if decay_type == "linear":
        remaining = 1.0 - progress
    elif decay_type == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    elif decay_type == "cosine":
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown decay_type {decay_type!r}")
    return min_lr_factor + (1.0 - min_lr_factor) * remaining


def build_lr_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int,
                       decay_ratio: float | None, decay_type: str, min_lr_factor: float):
    """A LambdaLR whose `last_epoch` counts optimizer steps taken; `scheduler.step()` after each update."""
    if warmup_steps > total_steps and (not dist.is_initialized() or dist.get_rank() == 0):
        # Not refused: a short trial run of a config (--training.steps 1) is legitimate; but said, since the peak
        # lr is never reached.
        logger.warning(f"lr_scheduler.warmup_steps = {warmup_steps} is longer than the run (training.steps = "
                       f"{total_steps}): the lr ramps up for the whole run and ends at "
                       f"{total_steps / (warmup_steps + 1):.0%} of optimizer.lr ({total_steps}/{warmup_steps + 1}); "
                       f"lower warmup_steps to reach the peak")
    # LambdaLR evaluates the factor for its internal counter, which is 0 before the first update, so
    # shift by one: the lr in force for update n is lr_factor(n).
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda n: lr_factor(n + 1, total_steps, warmup_steps, decay_ratio, decay_type, min_lr_factor),
    )
