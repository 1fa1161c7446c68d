"""Weights in and out of a run in the Hugging Face layout: initial load of an HF folder, export at the end."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from models.qwen35_moe import Qwen35MoeArgs, Qwen35MoeStateDictAdapter, load_hf_state_dict, save_hf_checkpoint

from .tokenizer import ByteTokenizer, HFTokenizer

logger = logging.getLogger(__name__)


def load_hf_weights(model: nn.Module, args: Qwen35MoeArgs, path: str) -> None:
    """Set the (possibly sharded) model's weights from an HF checkpoint folder; every rank reads it."""
    native = Qwen35MoeStateDictAdapter(args).from_hf(load_hf_state_dict(path))
    set_model_state_dict(model, native, options=StateDictOptions(full_state_dict=True, strict=True))
    logger.info("initialised weights from HF checkpoint %s", path)


def export_hf(model: nn.Module, args: Qwen35MoeArgs, folder: str, dtype: torch.dtype, rank: int,
              tokenizer: ByteTokenizer | HFTokenizer | None = None) -> None:
    """Write the model's weights as a Hugging Face folder; every rank helps gather, rank 0 writes.

    With `tokenizer` (the one the run trained with), the folder also holds its tokenizer files, published in
    the same rename as the weights, and config.json carries its BOS / EOS ids, so `AutoTokenizer` and
    `generate` work on the folder as it is.
    """
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        extra_files = None
        if tokenizer is not None:
            args = dataclasses.replace(args, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
            extra_files = tokenizer.save_pretrained
        save_hf_checkpoint(state, args, folder, dtype=dtype, extra_files=extra_files)
        logger.info("exported Hugging Face checkpoint to %s", os.path.abspath(folder))
    if dist.is_initialized():  # the other ranks wait for rank 0's write (NCCL: name the device, no warning)
        dist.barrier(device_ids=[torch.cuda.current_device()] if dist.get_backend() == "nccl" else None)
