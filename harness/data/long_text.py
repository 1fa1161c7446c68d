"""Long text documents tokenized a piece at a time, with the ids of one call.

A document is legitimately long (documents are packed across rows), but a tokenizer holds all of one call's encoding
at once: a 50 MB document took 9.2 GB of memory (10.5 GB with a byte-level BPE) and 141 s in one call of
`tokenizers`, where pieces of 1 MiB took 0.5-0.7 GB and 53-68 s; and no signal is handled until the call returns.
So a document longer than PIECE_CHARS is cut into pieces of about PIECE_CHARS characters, each tokenized alone:
after a newline followed by a non-space character, else (a line longer than a piece) between two words. No
pre-token of a byte-level BPE's split (GPT-2's, Qwen's) spans such a cut, so the pieces' ids are the document's.
Not every tokenizer splits so (one that marks the start of every call, as a Metaspace prefix does, or merges across
newlines): each cut is checked first by tokenizing CHECK_CHARS of context on either side whole and cut, and a
document with a cut that changes the ids there is tokenized in one call, as a short one is.
"""

from __future__ import annotations

import re

import numpy as np

PIECE_CHARS = 1 << 20  # characters of a piece; a document up to this long is tokenized in one call
CHECK_CHARS = 1 << 10  # context on either side of a cut, tokenized whole and cut to check it
_AFTER_NEWLINE = re.compile(r"\n(?=\S)")
_BETWEEN_WORDS = re.compile(r"(?<=\S) (?=\S)")


def encode_text(tokenizer, text: str) -> list[int] | np.ndarray:
    """`tokenizer.encode(text)`: a list, or for a document cut into pieces an int64 array."""
    cuts = _cuts(text)
    if not cuts or not all(_cut_keeps_ids(tokenizer, text, cut) for cut in cuts):
        return tokenizer.encode(text)
    bounds = [0, *cuts, len(text)]
    return np.concatenate([np.asarray(tokenizer.encode(text[a:b]), dtype=np.int64)
                           for a, b in zip(bounds, bounds[1:])])


def _cuts(text: str) -> list[int]:
    """Where the pieces of `text` start after the first, each about PIECE_CHARS after the one before."""
    cuts, start = [], 0
    while len(text) - start > PIECE_CHARS:
        stop = start + PIECE_CHARS
        found = _AFTER_NEWLINE.search(text, stop, stop + PIECE_CHARS) or _BETWEEN_WORDS.search(text, stop)
        if found is None:  # one word to the end: the rest is the last piece
            break
        start = found.end() if found.re is _AFTER_NEWLINE else found.start()
        cuts.append(start)
    return cuts


def _cut_keeps_ids(tokenizer, text: str, cut: int) -> bool:
    before, after = text[max(cut - CHECK_CHARS, 0): cut], text[cut: cut + CHECK_CHARS]
    return list(tokenizer.encode(before + after)) == list(tokenizer.encode(before)) + list(tokenizer.encode(after))
