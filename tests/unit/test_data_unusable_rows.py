"""Rows that are valid JSON lines yet cannot be used: a lone surrogate (no tokenizer encodes it), JSON nested deeper
than Python reads, an integer longer than Python converts. Each is a damaged row: left out, counted and the first
named (file:line and why), in text and chat data alike, in the cache build and in streams; a dataset of only such
rows is a DataError, and a run on one exits 2 with one `error:` line. (A line that is not JSON at all stays fatal:
test_bad_data.py.)"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from harness.data.chat import ChatOptions
from harness.data.errors import DataError
from harness.data.loader import build_dataloader
from harness.data.tokenizer import ByteTokenizer, HFTokenizer
from harness.train import BAD_INPUT, main
from tests.unit.test_data import fake_datasets

REPO = Path(__file__).resolve().parents[2]
CHAT_TOKENIZER = HFTokenizer(str(REPO / "data" / "debug_chat" / "tokenizer"))  # byte-level, with a chat template
CONVERSATION = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]

# name: (the raw JSON of the text or of a field beside it, what the reason says)
UNUSABLE = {
    "lone_surrogate": ('"a\\ud800b"', r"lone surrogate \\ud800"),
    "nested_100000_deep": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "integer_of_5000_digits": ("7" * 5000, r"a value Python does not read \(Exceeds the limit \(\d+ digits\) for "
                                           r"integer string conversion: value has 5000 digits\)$"),
}


def text_line(case: str) -> str:
    raw, _ = UNUSABLE[case]
    if case == "lone_surrogate":
        return '{"text": ' + raw + "}"
    return '{"text": "fine", "unused": ' + raw + "}"  # a value the run never reads still spoils the row


def chat_line(case: str) -> str:
    raw, _ = UNUSABLE[case]
    if case == "lone_surrogate":
        return json.dumps({"messages": [{"role": "user", "content": "@"}, CONVERSATION[1]]}).replace("@", "a\\ud800b")
    return json.dumps({"messages": CONVERSATION, "unused": "@"}).replace('"@"', raw)


def write(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def build(source: Path, cache_dir: Path, data_format: str, tok) -> object:
    seq_len = 64 if data_format == "chat" else 16  # a row: two conversations, or a few documents
    return build_dataloader("jsonl", str(source), "text", tok, seq_len, 1, cache_dir=cache_dir, data_format=data_format,
                            chat=ChatOptions(max_row_bytes=1 << 20) if data_format == "chat" else None)  # rows read


FORMATS = {"text": (text_line, json.dumps({"text": "a good document"})),
           "chat": (chat_line, json.dumps({"messages": CONVERSATION}))}


@pytest.mark.parametrize("data_format, tok", [("text", ByteTokenizer()), ("text", CHAT_TOKENIZER),
                                             ("chat", CHAT_TOKENIZER)], ids=["text-byte", "text-hf", "chat-hf"])
@pytest.mark.parametrize("case", UNUSABLE)
def test_a_valid_json_row_that_cannot_be_used_is_left_out_counted_and_named(tmp_path, case, data_format, tok, caplog):
    line, good = FORMATS[data_format]
    source = write(tmp_path / "d.jsonl", good, line(case), good)
    with caplog.at_level(logging.WARNING, logger="harness.data"):
        cache = build(source, tmp_path / "cache", data_format, tok).cache
    assert len(cache.doc_starts) == 2
    skipped = cache.meta["skipped_rows"]
    assert skipped["count"] == 1 and skipped["first"].startswith(f"{source}:2: "), skipped
    assert re.search(UNUSABLE[case][1], skipped["first"]), skipped
    assert [r.getMessage() for r in caplog.records if "left out" in r.getMessage()] != []


@pytest.mark.parametrize("data_format", FORMATS)
def test_a_dataset_of_only_unusable_rows_is_an_error_naming_the_first(tmp_path, data_format):
    line, _ = FORMATS[data_format]
    source = write(tmp_path / "d.jsonl", *(line(case) for case in UNUSABLE))
    with pytest.raises(DataError, match=r"holds no (documents|conversations): all its 3 rows .*\(the first: "
                                        r".*d\.jsonl:1: .*lone surrogate"):
        build(source, tmp_path / "cache", data_format, CHAT_TOKENIZER)


# -- streams: rows come as Python objects ----------------------------------------------------------------------------


def test_a_streamed_text_row_with_a_lone_surrogate_is_left_out_and_counted(monkeypatch):
    fake_datasets(monkeypatch, [{"text": "one"}, {"text": "a\ud800b"}, {"text": "two"}])
    for tok in (ByteTokenizer(), CHAT_TOKENIZER):
        loader = build_dataloader("hf", "fake/corpus", "text", tok, 2, 1, infinite=False)
        rows = list(loader)
        assert loader.packer.skipped == 1
        stream = [int(t) for row in rows for t in row["input_ids"][0]]
        assert "\ufffd" not in tok.decode(stream) and "b" not in tok.decode(stream)


def test_a_streamed_chat_row_with_a_lone_surrogate_is_left_out_and_counted(monkeypatch):
    bad = [{"role": "user", "content": "a\ud800b"}, CONVERSATION[1]]
    fake_datasets(monkeypatch, [{"messages": CONVERSATION}, {"messages": bad}, {"messages": CONVERSATION}])
    loader = build_dataloader("hf", "fake/chats", "text", CHAT_TOKENIZER, 32, 1, infinite=False, data_format="chat")
    assert len(list(loader)) == 1 and loader.packer.skipped == 1


class PassesLimited:
    """A streamed dataset whose passes are counted: a packer that reads it again and again would never end."""

    def __init__(self, rows: list[dict], limit: int = 3):
        self.rows, self.limit, self.passes = rows, limit, 0

    def __iter__(self):
        self.passes += 1
        assert self.passes <= self.limit, "the packer read the stream again and again without a row to show for it"
        return iter(self.rows)


@pytest.mark.parametrize("data_format", ["text", "chat"])
def test_a_stream_of_only_unusable_rows_is_an_error_not_an_endless_read(monkeypatch, data_format):
    bad = "a\ud800b"
    rows = ([{"text": bad}, {"text": bad}] if data_format == "text" else
            [{"messages": [{"role": "user", "content": bad}, CONVERSATION[1]]}] * 2)
    fake_datasets(monkeypatch, PassesLimited(rows))
    loader = build_dataloader("hf", "fake/rows", "text", CHAT_TOKENIZER, 32, 1, data_format=data_format)
    with pytest.raises(DataError, match=r"dp rank 0 of 1 has nothing to train on: all 2 rows of its shard of the "
                                        r"dataset were left out or hold no target \(the first: Hugging Face dataset "
                                        r"'fake/rows' \(dp rank 0 of 1\) row 0: .*lone surrogate"):
        next(loader)


# -- through the entry point -----------------------------------------------------------------------------------------


def test_train_on_a_dataset_of_only_unusable_rows_exits_2_with_one_line(tmp_path, capsys, own_logging):
    source = write(tmp_path / "d.jsonl", *(text_line(case) for case in UNUSABLE))
    code = main(["--training.steps", "1", "--training.seq_len", "16", "--training.local_batch_size", "1",
                 "--training.dataset_path", str(source), "--metrics.enable_tensorboard", "false",
                 "--checkpoint.export_hf_at_end", "false", "--job.dump_folder", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == BAD_INPUT and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "all its 3 rows" in errors[0] and f"{source}:1: " in errors[0], err
