"""Packed rows, the contract the model relies on (docs/design.md, "Packed documents"); every loader's batches are dicts
of (batch_size, seq_len) int64 tensors built here: input_ids, labels, position_ids.

Text (`packed_row`):
  - each document becomes [bos if the tokenizer has one] + tokens + [eos if it has one]; the documents are
    concatenated into one token stream;
  - row k is the window stream[k*L : k*L + L + 1] (L = seq_len): input_ids = window[:-1], labels = window[1:].
    Windows overlap by one token, so every token is an input once and every next-token pair is a label once;
  - labels are -100 where the next token starts another document: never predict across a boundary;
  - position_ids restart at 0 at every document start and at every row start. A document cut by a row end
    continues in the next row with positions from 0 again: the model treats each row start as a document
    start (GDN state, conv history and attention reset there), the usual cost of packing without padding.
Chat (`chat_row`): whole conversations in a padded window (harness/data/chat_packing.py), labelled on their targets.
"""

from __future__ import annotations

import numpy as np
import torch

from .chat_packing import chat_window

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index


def packed_row(window: torch.Tensor, starts: torch.Tensor) -> dict[str, torch.Tensor]:
    """One row from a window of L + 1 stream tokens (int64) and its flags (bool): does a document start here?"""
    L = window.numel() - 1
    labels = window[1:].clone()
    labels[starts[1:]] = IGNORE_INDEX  # the next token opens another document
    row_starts = starts[:-1].clone()
    row_starts[0] = True  # every row start is a document start for the model
    idx = torch.arange(L)
    last_start = torch.where(row_starts, idx, 0).cummax(0).values
    return {"input_ids": window[:-1], "labels": labels, "position_ids": idx - last_start}


def chat_row(pieces: list[tuple[np.ndarray, np.ndarray]], row_tokens: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One row of whole conversations (harness/data/chat_packing.py): the packed row of their padded window, with
    every label that is not a target of the same conversation set to -100."""
    window, starts, targets = chat_window(pieces, row_tokens, pad_id)
    row = packed_row(torch.from_numpy(window), torch.from_numpy(starts))
    row["labels"][~torch.from_numpy(targets[1:])] = IGNORE_INDEX
    return row


def stack_rows(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A batch: the rows' tensors stacked along a new first dimension."""
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def check_loader_args(seq_len: int, batch_size: int, dp_rank: int, dp_world_size: int) -> None:
    """A ValueError for a loader that could build no row (a caller's error, not bad data)."""
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len ({seq_len}) and batch_size ({batch_size}) must be positive")
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_world_size={dp_world_size})")
