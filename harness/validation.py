"""Held-out loss: the token-mean cross entropy of a validation set, data-parallel like training.

Every validation reads the same rows (a fresh loader from row 0 of the set's token cache), `validation.steps`
micro-batches of training's local_batch_size x seq_len per data-parallel rank (-1: the whole set), and reduces
the summed loss and label-token count over all ranks. The MoE balance loss is a training regulariser and is
not part of it. A set that gives no target token (too few rows for one micro-batch of all data-parallel ranks, which
is known before the run for a cached set; or a stream that ends first) is a DataError: a loss of 0 over nothing
would read as a perfect model. A model with MTP layers also gets, trained or frozen (a frozen MTP layer drifts as the model it
drafts for is fine-tuned):
- `val_mtp_loss`: the token mean of their cross entropy over their targets (pooled over the depths; the releases
  have one);
- `val_mtp_accept`: how often greedy speculative decoding would accept the first drafted token, teacher-forced: at
  each position t with a valid x_{t+2} target, whether the MTP's argmax for x_{t+2} is the main model's argmax at
  t+1, the token it would emit itself there (`draft_matches`).
"""

from __future__ import annotations

import itertools
import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from models.qwen35_moe.kernels.linear_cross_entropy import CHUNK_TOKENS
from parallel.context_parallel import shard_zigzag
from parallel.parallelize import reshard_fsdp

from .config import JobConfig
from .data.cached import TokenCacheLoader
from .data.errors import DataError
from .data.rows import IGNORE_INDEX
from .data_setup import build_data_loader
from .model_setup import brought_to

logger = logging.getLogger(__name__)


def _another_source(cfg: JobConfig) -> str:
    """A word where the validation set does not come from where the training data does (a config's own set kept
    while training on another file: the held-out loss then measures the config's set, not the user's)."""
    v, t = cfg.validation, cfg.training
    if v.dataset_source == "hf" or t.dataset_source == "hf":
        return ""
    if os.path.dirname(os.path.abspath(v.dataset_path)) == os.path.dirname(os.path.abspath(t.dataset_path)):
        return ""
    return (f", not beside the training data ({t.dataset_path}): set validation.dataset_path to your own held-out "
            "rows, or validation.enable false")


class Validator:
    def __init__(self, cfg: JobConfig, tokenizer, dp_rank: int, dp_world_size: int, device: torch.device,
                 model_inputs, mtp: bool = False):
        """`model_inputs`: the model's keyword arguments (input_ids, labels, layout, ...) for a batch of host rows,
        this rank's share of them (its zigzag chunks under context parallelism); `Trainer.model_inputs`. `mtp`: the
        model has MTP layers (`val_mtp_loss`)."""
        v, t = cfg.validation, cfg.training
        self.steps = None if v.steps == -1 else v.steps
        self.device, self.model_inputs, self.mtp = device, model_inputs, mtp
        self.loader = build_data_loader(cfg, "validation", tokenizer, dp_rank, dp_world_size, infinite=False)
        self.start = self.loader.state_dict()  # every validation rewinds to here: the same rows each time
        self.what = f"{v.dataset_path} (validation.steps = {v.steps})"
        if (dist.get_rank() if dist.is_initialized() else 0) == 0:
            logger.info("validation: every %d steps on %s%s", v.freq, os.path.abspath(v.dataset_path)
                        if v.dataset_source != "hf" else v.dataset_path, _another_source(cfg))
        rows_needed = dp_world_size * t.local_batch_size
        if isinstance(self.loader, TokenCacheLoader) and self.loader.num_rows < rows_needed:
            raise _on_every_rank(DataError(
                f"the validation set {v.dataset_path} has {self.loader.num_rows} rows of seq_len + 1 = {t.seq_len + 1} "
                f"tokens, fewer than one micro-batch of all data-parallel ranks ({rows_needed} = {dp_world_size} ranks "
                f"x local_batch_size {t.local_batch_size}): it gives no validation loss; use a larger set, or a "
                f"smaller training.local_batch_size"))

    @torch.no_grad()
    def validate(self, model: nn.Module) -> dict[str, float]:
        """{"val_loss", "val_tokens"} (and "val_mtp_loss") over the validation rows of all ranks."""
        was_training = model.training
        model.eval()
        # loss sum, label tokens; MTP loss sum, MTP targets, accepted first drafts, first drafts
        totals = torch.zeros(6, device=self.device)
        self.loader.load_state_dict(self.start)
        with brought_to(model.mtp if self.mtp else None, self.device):  # a LoRA run's MTP waits on the host
            for batch in itertools.islice(self.loader, self.steps):
                inputs = self.model_inputs(batch, mtp=self.mtp)
                out = model(**inputs, return_hidden=self.mtp)
                totals[0] += out.ce_sum
                totals[1] += (inputs["labels"] != IGNORE_INDEX).sum()
                if self.mtp:
                    totals[2] += out.mtp_ce_sum
                    totals[3] += (inputs["mtp_labels"] != IGNORE_INDEX).sum()
                    totals[4:] += torch.stack(draft_matches(model, inputs, out))
        if dist.is_initialized():
            dist.all_reduce(totals)
        reshard_fsdp(model)  # a forward without backward leaves reshard_after_forward=False units gathered
        model.train(was_training)
        if totals[1] == 0:  # the same on every rank (all-reduced)
            raise _on_every_rank(DataError(f"validation read no target token from {self.what}: a streamed set "
                                           f"shorter than one micro-batch of all data-parallel ranks? Use a larger set"))
        result = {"val_loss": (totals[0] / totals[1].clamp_min(1)).item(), "val_tokens": int(totals[1].item())}
        if self.mtp:
            result["val_mtp_loss"] = (totals[2] / totals[3].clamp_min(1)).item()
            result["val_mtp_accept"] = (totals[4] / totals[5].clamp_min(1)).item()
        return result


def _on_every_rank(error: DataError) -> DataError:
    """`error`, marked as met by every rank alike: rank 0 alone prints it (harness/train.py)."""
    error.every_rank = True
    return error


def draft_matches(model: nn.Module, inputs: dict, out) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted, drafted) first draft tokens of a forward with `mtp=True, return_hidden=True` on `inputs` (the
    model's keyword arguments, with `mtp_labels`): at each position t whose x_{t+2} target is valid, the MTP's argmax
    for x_{t+2} against the main model's argmax at t+1. Under context parallelism the main model's picks are
    gathered into whole rows for the shift to t+1, then this rank's chunks taken again."""
    chunk = inputs.get("loss_chunk_tokens", CHUNK_TOKENS)
    main = _greedy(model.lm_head, out.hidden, chunk)
    draft = _greedy(model.lm_head, out.mtp_hidden[0], chunk)
    cp = model.context_parallel
    whole = main if cp is None else cp.gather_sequence(main)
    following = torch.cat((whole[:, 1:], whole[:, -1:]), dim=1)  # at t: the main model's pick at t+1
    if cp is not None:
        following = shard_zigzag(following, cp.size, cp.rank)
    drafted = inputs["mtp_labels"][..., 0] != IGNORE_INDEX
    return ((draft == following) & drafted).sum(), drafted.sum()


def _greedy(head: nn.Module, h: torch.Tensor, chunk: int) -> torch.Tensor:
    """(B, S, D) hidden states -> (B, S) argmax of the head's logits, `chunk` tokens of logits at a time."""
    flat = h.flatten(0, 1)
    step = chunk if chunk > 0 else max(flat.shape[0], 1)
    picks = [head(flat[start:start + step]).argmax(-1) for start in range(0, flat.shape[0], step)]
    return torch.cat(picks).view(h.shape[:2])
