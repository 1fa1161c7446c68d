"""The run's data loaders from its config: the one place that maps the config's [training] and [validation] data keys
onto harness/data/ (which knows no config)."""

from __future__ import annotations

import os

from .data.chat import ChatOptions
from .data.loader import build_dataloader


def chat_options(cfg) -> ChatOptions:
    """The chat keys of a run's training section; validation reads its set with them."""
    t = cfg.training
    return ChatOptions(t.chat_messages_field, t.chat_targets, t.chat_overlong, t.chat_max_row_bytes)


def dataset_cache_dir(cfg) -> str:
    return cfg.training.dataset_cache_dir or os.path.join(cfg.job.dump_folder, "dataset_cache")


def build_data_loader(cfg, section: str, tokenizer, dp_rank: int, dp_world_size: int, infinite: bool = True):
    """The loader of `section`'s data ("training" or "validation": where the rows come from) with training's rows
    (seq_len, local_batch_size), content and chat keys, this data-parallel rank's share."""
    s, t = getattr(cfg, section), cfg.training
    return build_dataloader(s.dataset_source, s.dataset_path, s.dataset_text_field, tokenizer, t.seq_len,
                            t.local_batch_size, dp_rank=dp_rank, dp_world_size=dp_world_size,
                            cache_dir=dataset_cache_dir(cfg), infinite=infinite, cache_verify=t.dataset_cache_verify,
                            data_format=t.dataset_content, chat=chat_options(cfg))
