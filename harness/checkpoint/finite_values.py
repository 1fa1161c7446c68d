"""Whether a weight read from a Hugging Face folder holds only finite values. A NaN or an infinity there is damage
(a broken download or conversion): without this check a run meets it as a NaN loss at its first step (exit 3, "lower
optimizer.lr") instead of as the bad input it is (exit 2, naming the weights). HF folders carry no digests, unlike
the run's own checkpoints (integrity.py)."""

from __future__ import annotations

import torch

from models.qwen35_moe.fp8_blocks import FP8


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool on t's device, not read here (a load reads them all at once, one host sync), and computed by
    reductions alone: no temporary the size of `t` beside a model that fills the device."""
    if t.dtype == FP8:  # e4m3fn has no infinity; its NaNs are the bytes 0x7f and 0xff, each the maximum of one view
        return (t.view(torch.int8).amax() != 127) & (t.view(torch.uint8).amax() != 255)
    if not t.is_floating_point() or t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    low, high = torch.aminmax(t)  # a NaN anywhere makes both NaN; an infinity is one of them
    return torch.isfinite(low) & torch.isfinite(high)


def non_finite(checked: list[tuple[str, torch.Tensor]]) -> list[str]:
    """The names among `checked` ((name, all_finite's flag)) whose tensors hold a NaN or an infinity."""
    if not checked:
        return []
    flags = torch.stack([flag for _, flag in checked]).tolist()  # one transfer: the flags share the model's device
    return [name for (name, _), ok in zip(checked, flags) if not ok]
