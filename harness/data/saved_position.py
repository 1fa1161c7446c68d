"""A saved data position checked before a loader resumes from it, the same check for every loader: a state of this
kind of loader, with its values of the types the loader writes, saved with the settings its rows depend on. A state
that does not fit is a DataError naming the difference and what to keep the same (bad input: exit 2), never a crash
or a silent restart at another position.
"""

from __future__ import annotations

from .errors import DataError

# The kinds of loaders, as their states are named
CACHED, STREAMED_TEXT, STREAMED_CHAT = "local (cached) dataset", "streamed text dataset", "streamed chat dataset"
_MARK = {CACHED: "no 'next_row'", STREAMED_TEXT: "no 'doc_index'", STREAMED_CHAT: "no format 'chat'"}
_EARLIER = {CACHED: {"packing": "text"}}  # what a state leaves out: a text cache loader's state names no packing

# A setting saved with the position and this run's value of it differ: what the saved rows are (formatted with
# `saved`, `now` and the loader's `source`), and what a resume must keep the same.
_DIFFERENCE = {
    "packing": ("rows packed as {saved!r}, this run packs them as {now!r}: rows would not line up",
                "training.dataset_content and training.chat_overlong"),
    "seq_len": ("rows of seq_len {saved}, this run has seq_len {now}: rows would not line up", "training.seq_len"),
    "tokenizer_id": ("tokens of another tokenizer (id {saved}, this run {now}, see {source}/meta.json)",
                     "model.tokenizer_path"),
    "stream_id": ("another dataset (token stream {saved}, this run {now} from {source}): were files added or changed?",
                  "dataset, or start in another job.dump_folder"),
    "dp_rank": ("the shard of dp rank {saved}, this run is dp rank {now}: streamed (hf) datasets are sharded by rank",
                "data-parallel degree"),
    "dp_world_size": ("shards of {saved} data-parallel ranks, this run has {now}: streamed (hf) datasets are sharded "
                      "by rank", "data-parallel degree"),
    "chat_overlong": ("rows packed with chat_overlong {saved!r}, this run has {now!r}", "training.chat_overlong"),
}


def kind_of(state: object) -> str | None:
    """Which kind of loader saved `state` (None: none this version knows)."""
    if not isinstance(state, dict):
        return None
    if "next_row" in state:
        return CACHED
    if state.get("format") == "chat":
        return STREAMED_CHAT
    return STREAMED_TEXT if "doc_index" in state else None


def check_saved_position(state: object, kind: str, position: dict[str, type], settings: dict[str, object],
                         source: str = "") -> dict:
    """`state` (with what an earlier state left out filled in) when a `kind` loader can resume from it, else a
    DataError. `position`: the keys of the position itself and their types; `settings`: this run's value of each
    setting the saved rows depend on (keys of _DIFFERENCE); `source`: where this loader reads its rows from."""
    saved_kind = kind_of(state)
    if saved_kind is None:
        raise DataError(f"the saved data loader state is not that of a {kind}: it has {_MARK[kind]} (another version "
                        f"saved it, or it is damaged) and cannot resume the data of this run")
    if saved_kind != kind:
        raise DataError(f"the saved data loader state is not that of a {kind}: it is that of a {saved_kind} and cannot "
                        f"resume the {kind} of this run; resume with the same training.dataset_source and "
                        f"training.dataset_content")
    state = {**_EARLIER.get(kind, {}), **state}
    for key, kind_of_value in {**position, **{key: type(now) for key, now in settings.items()}}.items():
        value = state.get(key)
        if not isinstance(value, kind_of_value) or isinstance(value, bool):
            raise DataError(f"the saved data loader state has {key}={value!r} where a {kind_of_value.__name__} "
                            f"belongs: it was saved by another version or is damaged")
    for key, now in settings.items():
        if state[key] != now:
            what, keep = _DIFFERENCE[key]
            raise DataError(f"the saved data position is in {what.format(saved=state[key], now=now, source=source)}; "
                            f"resume with the same {keep}")
    return state
