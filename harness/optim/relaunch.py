"""A relaunch's optimizer settings on top of a loaded optimizer and LR schedule: what the checkpoint restored (the
parameter groups and the schedule's peak lr as saved) gets this launch's `[optimizer]` values, and the lr of the next
update is recomputed under this launch's schedule (harness/config/resume.py says what else a relaunch changes)."""

from __future__ import annotations

import torch

from parallel.torch_internals import set_last_lr

from ..config import JobConfig


def apply_optimizer_settings(optimizer: torch.optim.Optimizer, lr_scheduler, cfg: JobConfig) -> list[str]:
    """Set the relaunch's optimizer settings on a loaded optimizer and LR schedule (built by harness/optim);
    returns one `optimizer.<key> old -> new` line per value that changed."""
    o = cfg.optimizer
    # Group 0 holds the matrices (decayed), group 1 the 1-D parameters (never decayed): optim/optimizer.py.
    wanted = [{"betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay if i == 0 else 0.0,
               "decoupled_weight_decay": o.name == "AdamW"} for i in range(len(optimizer.param_groups))]
    changed: dict[str, tuple] = {}
    for group, want in zip(optimizer.param_groups, wanted):
        for key, value in want.items():
            old = tuple(group[key]) if key == "betas" else group.get(key)
            if old != value and key not in changed:
                changed[key] = (old, value)
            group[key] = value
    for i, group in enumerate(optimizer.param_groups):
        if lr_scheduler.base_lrs[i] != o.lr and "lr" not in changed:
            changed["lr"] = (lr_scheduler.base_lrs[i], o.lr)
        lr_scheduler.base_lrs[i] = group["initial_lr"] = o.lr
        # The lr in force for the next update under the relaunch's schedule (lr_schedule.build_lr_scheduler).
        group["lr"] = o.lr * lr_scheduler.lr_lambdas[i](lr_scheduler.last_epoch)
    set_last_lr(lr_scheduler, [group["lr"] for group in optimizer.param_groups])
    lines = []
    for key, (old, new) in changed.items():
        if key == "decoupled_weight_decay":
            lines.append(f"optimizer.name {'AdamW' if old else 'Adam'} -> {o.name}")
        elif key == "weight_decay":
            lines.append(f"optimizer.weight_decay {old} -> {new}")
        else:
            lines.append(f"optimizer.{key} {list(old) if key == 'betas' else old} -> "
                         f"{list(new) if key == 'betas' else new}")
    return lines
