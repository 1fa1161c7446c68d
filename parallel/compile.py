"""torch.compile of the decoder blocks: each block's `runner` (models/qwen35_moe/hooks.py) becomes the compiled
`run_block`, the model's own forward of a block; the parameters, and with them the state dict's keys, stay as they
are. Under full activation checkpointing the blocks are compiled in halves instead (activation_checkpointing.py).

Under FSDP without expert parallelism the first block's routed experts are an FSDP unit of their own
(parallelize.apply_fsdp), whose hooks break that block's compiled graph at the MoE call. Dynamo keeps its compiled
frames per code object, and its guards skip FSDP-managed modules, so every block would reuse the first block's
frames, break included: the MoE and the residual add after it as two more graphs per block
(tests/distributed/test_compiled_frames.py counts each block's frames against one process's). The first block
then runs a copy of `run_block`'s code, whose frames are its own (torch_internals.function_with_own_frames).
"""

from __future__ import annotations

import torch

from models.qwen35_moe.hooks import BlockRunner
from models.qwen35_moe.model import run_block

from .torch_internals import function_with_own_frames


def compiled_runners(num_blocks: int, first_block_own_frames: bool = False) -> list[BlockRunner]:
    """One compiled runner per block, shared by all of them (dynamo keys graphs on the code and guards on what
    differs between blocks), the first block's apart if `first_block_own_frames`."""
    shared = torch.compile(run_block)
    first = torch.compile(function_with_own_frames(run_block, "run_first_block")) if first_block_own_frames else shared
    return [first] + [shared] * (num_blocks - 1)
