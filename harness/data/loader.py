"""Training data: the entry point, `build_dataloader`, over the four kinds of loader of the 2x2 of sources and rows:

                 text rows (documents)                      chat rows (conversations)
  local files    cached.py: TokenCacheLoader                 cached.py: ChatCacheLoader
  hf stream      streamed.py: StreamPacker (+ prefetch.py)   streamed.py: ChatStreamPacker (+ prefetch.py)

Documents come from harness/data/sources.py (local text / jsonl / parquet files, or a Hugging Face stream); rows are
packed as harness/data/rows.py says (text) or harness/data/chat_packing.py lays out (chat); a saved data position
is checked by harness/data/saved_position.py before a loader resumes from it.

The trainer calls `build_dataloader` on every rank of the world when torch.distributed is initialized. Its batches are
dicts of (batch_size, seq_len) int64 tensors: input_ids, labels (IGNORE_INDEX where no loss is taken), position_ids.
Context-parallel ranks of one DP rank pass the same dp_rank and get the same rows; they split them later.
"""

from __future__ import annotations

from pathlib import Path

from .cached import TokenCacheLoader, cached_rows
from .chat import ChatOptions
from .encoders import ChatEncoder
from .errors import DataError
from .prefetch import PrefetchingLoader
from .rows import IGNORE_INDEX, check_loader_args
from .sources import check_source
from .streamed import streamed_rows
from .token_cache import Verify

__all__ = ["DataError", "IGNORE_INDEX", "build_dataloader"]  # what the trainer and its builders read from here


def build_dataloader(kind: str, path: str, text_field: str, tokenizer, seq_len: int, batch_size: int,
                     dp_rank: int = 0, dp_world_size: int = 1, cache_dir: str | Path | None = None,
                     infinite: bool = True, cache_verify: Verify = "quick", data_format: str = "text",
                     chat: ChatOptions | None = None) -> TokenCacheLoader | PrefetchingLoader:
    """The trainer's entry point; collective over the whole world when torch.distributed is initialized.

    `kind` is the source (training.dataset_source), `data_format` what a row holds (training.dataset_content). Local
    kinds need `cache_dir` (the trainer passes training.dataset_cache_dir) and give a TokenCacheLoader over the cache,
    checked as `cache_verify` says (training.dataset_cache_verify); "hf" ignores both and gives a PrefetchingLoader
    over this DP rank's shard. `data_format` "chat": conversations (`chat`: the chat keys, its messages_field replaces
    `text_field`) rendered by the tokenizer's chat template, packed whole into padded rows. Bad data is a DataError
    (see harness/data/sources.py)."""
    check_source(kind, path)  # fail at build time, not at the first batch
    check_loader_args(seq_len, batch_size, dp_rank, dp_world_size)
    if data_format not in ("text", "chat"):
        raise ValueError(f"data_format {data_format!r}: expected 'text' or 'chat'")
    encoder = None
    if data_format == "chat":
        if kind == "text":
            raise DataError("chat data is read from jsonl, parquet or hf datasets (rows holding a list of messages), "
                            "not from text files; set training.dataset_source accordingly")
        chat = (chat or ChatOptions()).for_rows_of(seq_len)  # the row limit that applies
        encoder = ChatEncoder(tokenizer, chat)  # a DataError when the tokenizer has no chat template
    else:
        chat = None
    rows = (seq_len, batch_size, dp_rank, dp_world_size, infinite)
    if kind == "hf":
        return PrefetchingLoader(streamed_rows(path, text_field, tokenizer, *rows, chat, encoder))
    if cache_dir is None:
        raise ValueError(f"a cache_dir is needed for the local {kind} dataset {path}: it is tokenized once into "
                         f"that folder (the trainer passes training.dataset_cache_dir)")
    return cached_rows(kind, path, text_field, tokenizer, cache_dir, cache_verify, *rows, chat, encoder)
