"""The optimizer of a run (AdamW or Adam) with its parameter groups: on CUDA our FastAdam (one Triton launch per
parameter group, torch's math and state), elsewhere torch's own (its single-tensor step on CPU)."""

from __future__ import annotations

import torch
from torch import nn

from parallel.one_device_precision import weight_copies_of

from ..config import Optimizer as OptimizerConfig
from .fast_adam import FastAdam


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    # No weight decay on 1-D parameters (norm scales, A_log, dt_bias): decaying them pulls the norms
    # and the SSM decay rates toward zero rather than regularising anything.
    trained = [p for p in model.parameters() if p.requires_grad]  # not the frozen ones (a carried MTP layer)
    decay = [p for p in trained if p.ndim >= 2]
    no_decay = [p for p in trained if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Adam applies weight_decay as an L2 term in the gradient, AdamW decoupled from it.
    if device.type == "cuda":
        return FastAdam(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                        decoupled_weight_decay=cfg.name == "AdamW",
                        weight_copies=weight_copies_of(model))  # one GPU: kept bf16 copies
    cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
    # foreach=None, torch's default: its single-tensor step on CPU (the same math). The foreach step cannot take
    # plain tensors next to DTensors in one call, and under FSDP the GDN layers' fp32 parameters are plain
    # (parallel/replicated_params.py). None rather than False: a checkpoint stores the flag, and its step then
    # follows whichever device resumes it.
    return cls(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=None)
