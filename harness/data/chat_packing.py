"""Chat rows: whole conversations packed greedily into padded rows (the layout; the loaders that deal and resume the
rows are harness/data/cached.py's ChatCacheLoader and harness/data/streamed.py's ChatStreamPacker).

The contract (docs/design.md, "Chat data"), for L = seq_len and rows of R = L + 1 tokens:
  - a conversation is never split across rows: its reply must see its prompt. Conversations are taken in order;
    each goes into the current row if it fits in what is left of its R tokens, else it opens the next row. One
    longer than R tokens is dropped (training.chat_overlong = "drop") or cut to its first R tokens ("truncate");
  - the rest of a row is padding: input id `pad_id` (the tokenizer's EOS, or 0), never a label, and a document of
    its own (positions from 0), so nothing attends across it;
  - input_ids = window[:-1]; labels[i] = window[i + 1] where that token is a target (harness/data/chat.py) of the
    same conversation, else -100: -100 where the next token starts another conversation, is padding, or is not
    a target;
  - position_ids restart at 0 at every conversation and at the padding.
The layout (which conversations, how many of their tokens, in which row) is computed from the token cache, L and
chat_overlong alone, the same on every rank: rows are global and dealt to data-parallel ranks, and the state is the
rows consumed, exactly as for text (TokenCacheLoader). Hugging Face streams are packed per DP rank as they come,
their rows depend on the DP degree, as text streams' do.
Every conversation of a cache holds a target (harness/data/chat.py leaves out those without), so only a truncated
one can fill a row (it fills one alone) without a label: such rows are counted in the log, and a layout of nothing
else is a DataError naming chat_overlong, as a run on it would train on nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

import numpy as np

from .errors import DataError
from .token_cache import TokenCache


@dataclass(frozen=True)
class ChatLayout:
    """Conversations placed into rows: row k holds placements row_first[k]:row_first[k + 1], each the first
    `taken` tokens of cache document `docs`."""

    docs: np.ndarray  # (placements,) int64
    taken: np.ndarray  # (placements,) int64
    row_first: np.ndarray  # (rows + 1,) int64
    dropped: int
    truncated: int
    untargeted: int = 0  # rows without a target token: a conversation truncated before its first target

    @property
    def num_rows(self) -> int:
        return len(self.row_first) - 1


def pack_conversations(lengths: Iterable[int], row_tokens: int, overlong: str) -> ChatLayout:
    """Greedy, in order: each conversation joins the current row if it fits, else opens the next one."""
    docs, taken, row_first = [], [], [0]
    fill = dropped = truncated = 0
    for doc, n in enumerate(lengths):
        if n > row_tokens:
            if overlong == "drop":
                dropped += 1
                continue
            n, truncated = row_tokens, truncated + 1
        if fill + n > row_tokens:
            row_first.append(len(docs))
            fill = 0
        docs.append(doc)
        taken.append(n)
        fill += n
    if docs:
        row_first.append(len(docs))
    as_array = lambda values: np.asarray(values, dtype=np.int64)
    return ChatLayout(as_array(docs), as_array(taken), as_array(row_first), dropped, truncated)


def cache_layout(cache: TokenCache, row_tokens: int, overlong: str) -> ChatLayout:
    """The layout of a chat cache's conversations; a DataError when none is kept, or no row holds a target."""
    lengths = np.diff(cache.doc_starts, append=len(cache.tokens))
    layout = pack_conversations(lengths.tolist(), row_tokens, overlong)
    if layout.num_rows == 0:
        raise DataError(f"all {len(lengths)} conversations of dataset cache {cache.folder} are longer than "
                        f"seq_len + 1 = {row_tokens} tokens, and training.chat_overlong = 'drop' leaves them out: "
                        f"raise training.seq_len, or set training.chat_overlong = 'truncate'")
    kept, _ = _overlong_targets(cache, row_tokens, overlong)
    layout = replace(layout, untargeted=int(np.count_nonzero(kept == 0)) if overlong == "truncate" else 0)
    if layout.untargeted == layout.num_rows:
        raise DataError(f"none of the {layout.num_rows} rows of the chat dataset {_dataset_name(cache)} (cache "
                        f"{cache.folder}) holds a target token: training.chat_overlong = 'truncate' cut all "
                        f"{layout.truncated} conversations to their first seq_len + 1 = {row_tokens} tokens, before "
                        f"their first target; raise training.seq_len, or set training.chat_overlong = 'drop'")
    return layout


def _overlong_targets(cache: TokenCache, row_tokens: int, overlong: str) -> tuple[np.ndarray, int]:
    """The targets that conversations longer than `row_tokens` keep in their row (one count each, 0 when
    dropped) and lose, all together; only these conversations' flags are read."""
    starts = cache.doc_starts
    lengths = np.diff(starts, append=len(cache.tokens))
    kept, lost = [], 0
    for doc in np.flatnonzero(lengths > row_tokens).tolist():
        lo, cut = int(starts[doc]), 0 if overlong == "drop" else row_tokens
        kept.append(int(np.count_nonzero(cache.targets[lo: lo + cut])))
        lost += int(np.count_nonzero(cache.targets[lo + cut: lo + int(lengths[doc])]))
    return np.asarray(kept, dtype=np.int64), lost


def _dataset_name(cache: TokenCache) -> str:
    files = cache.meta["source"].get("files", [])
    return files[0]["path"] + (f" and {len(files) - 1} more files" if len(files) > 1 else "") if files else "?"


def layout_summary(layout: ChatLayout, cache: TokenCache, row_tokens: int, overlong: str) -> str:
    """Conversations kept, dropped and truncated, rows, the share of the rows' tokens that are targets and
    padding, and the rows without a target. The cache's targets are counted at build (meta.json); only those of
    conversations left out or cut are read here."""
    R = row_tokens
    tokens = layout.num_rows * R
    trained = cache.meta["targets"]["num_targets"] - _overlong_targets(cache, R, overlong)[1]
    padding = tokens - int(layout.taken.sum())
    untargeted = (f"; {layout.untargeted} rows ({layout.untargeted / layout.num_rows:.1%}) hold no target token "
                  f"(truncated before it)" if layout.untargeted else "")
    return (f"{len(layout.docs)} conversations kept, {layout.dropped} dropped and {layout.truncated} truncated (longer "
            f"than seq_len + 1 = {R} tokens; chat_overlong = {overlong!r}); {layout.num_rows} rows of {R} tokens: "
            f"{trained / tokens:.1%} targets, {padding / tokens:.1%} padding{untargeted}")


def chat_window(pieces: list[tuple[np.ndarray, np.ndarray]], row_tokens: int,
                pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The window of one row from whole conversations, (ids, target flags) each, that fit in `row_tokens` = L + 1
    together: (ids int64, document starts bool, targets bool), padded to `row_tokens` with `pad_id`."""
    window = np.full(row_tokens, pad_id, dtype=np.int64)
    targets = np.zeros(row_tokens, dtype=bool)
    starts = np.zeros(row_tokens, dtype=bool)
    pos = 0
    for ids, flags in pieces:
        n = len(ids)
        window[pos: pos + n], targets[pos: pos + n], starts[pos] = ids, flags, True
        pos += n
    if pos < row_tokens:
        starts[pos] = True  # the padding is a document of its own
    return window, starts, targets


def pad_id_of(tokenizer) -> int:
    """The padding's input id: any id in the vocabulary works (never a label, its own document); EOS, else 0."""
    return tokenizer.eos_id if tokenizer.eos_id is not None else 0


