"""The train and rank states of a checkpoint as bytes: written with torch.save, read back with
torch.load(weights_only=True), so that a checkpoint's own states never run code when they are read."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from .errors import CheckpointError, one_line


def to_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes, what: str, path: Path):
    """A train or rank state, with torch.load(weights_only=True): tensors and plain values, never code.

    No fallback to a full unpickling: every state this trainer has written (RNG states as tuples of ints and
    tensors, loader positions, the LR schedule's numbers, configs as dicts) loads this way, so one that does not was
    written by something else, and is refused."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001  (the unpickler's refusal, or bytes that are no torch.save at all)
        raise CheckpointError(f"checkpoint {path}: its {what} state holds more than tensors and plain values, which "
                              f"this trainer never writes ({one_line(e)}); it is not unpickled. Was the checkpoint "
                              "written by another program?") from None
