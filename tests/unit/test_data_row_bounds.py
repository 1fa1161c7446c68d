"""The work a single row costs is bounded. A chat row larger than training.chat_max_row_bytes (by default 16 bytes a
token of a row: far more than seq_len + 1 tokens) is left out before it is parsed, rendered or tokenized, and counted
with the conversations that cannot be trained on; the chat cache is keyed by the limit. A long text document is
legitimate (documents are packed across rows): it is tokenized a piece at a time, with the ids of one call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.config import load_config
from harness.data.chat import ChatOptions
from harness.data.encoders import ChatEncoder, TextEncoder
from harness.data.errors import DataError
from harness.data.loader import build_dataloader
from harness.data.tokenizer import ByteTokenizer, HFTokenizer
from harness.data_setup import chat_options
from tests.unit.test_data import fake_datasets

REPO = Path(__file__).resolve().parents[2]
CHAT_TOKENIZER = HFTokenizer(str(REPO / "data" / "debug_chat" / "tokenizer"))
SEQ_LEN = 64
LIMIT = 16 * (SEQ_LEN + 1)  # the default: 16 bytes a token of a row
PIECE_CHARS = "harness.data.long_text.PIECE_CHARS"  # set small below, so that short texts are cut into pieces


@pytest.fixture(autouse=True)
def short_checks(monkeypatch):
    monkeypatch.setattr("harness.data.long_text.CHECK_CHARS", 32)  # the context tokenized to check a cut


def conversation(line_bytes: int) -> str:
    """A JSON line of exactly `line_bytes` bytes (its newline not counted)."""
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]}
    pad = line_bytes - len(json.dumps(row))
    row["messages"][1]["content"] = "y" * pad
    return json.dumps(row)


def spy_on_rendering(monkeypatch) -> list[int]:
    """The number of messages characters of each row the chat encoder renders."""
    seen, real = [], ChatEncoder.__call__

    def spied(self, row):
        seen.append(len(json.dumps(row.value)))
        return real(self, row)

    monkeypatch.setattr(ChatEncoder, "__call__", spied)
    return seen


def chat_loader(source: Path, tmp_path: Path, **options):
    return build_dataloader(source.suffix.lstrip("."), str(source), "text", CHAT_TOKENIZER, SEQ_LEN, 1,
                            cache_dir=tmp_path / "cache", data_format="chat",
                            chat=ChatOptions(overlong="truncate", **options))


def test_a_chat_row_larger_than_the_limit_is_left_out_unrendered_and_counted(tmp_path, monkeypatch):
    source = tmp_path / "chats.jsonl"
    source.write_text("\n".join([conversation(100), conversation(LIMIT), conversation(LIMIT + 1),
                                 conversation(50 * LIMIT), conversation(100)]) + "\n")
    rendered = spy_on_rendering(monkeypatch)
    cache = chat_loader(source, tmp_path).cache
    assert rendered == [100, LIMIT, 100]  # the larger ones never reached the template
    assert len(cache.doc_starts) == 3
    assert cache.meta["skipped_rows"] == {"count": 2, "first": f"{source}:3: its line has more than {LIMIT} bytes "
                                          f"(training.chat_max_row_bytes: by default 16 bytes a token of a row of "
                                          f"seq_len + 1 tokens), far more than a row holds; left out unread"}


def test_the_row_limit_is_raised_by_its_key_and_keys_the_chat_cache(tmp_path):
    source = tmp_path / "chats.jsonl"
    source.write_text("\n".join([conversation(100), conversation(2 * LIMIT)]) + "\n")
    default = chat_loader(source, tmp_path).cache
    raised = chat_loader(source, tmp_path, max_row_bytes=2 * LIMIT).cache
    assert default.meta["skipped_rows"]["count"] == 1 and raised.meta["skipped_rows"]["count"] == 0
    assert default.folder != raised.folder
    assert chat_options(load_config(["--training.chat_max_row_bytes", "5000"])).max_row_bytes == 5000
    assert chat_options(load_config([])).max_row_bytes == -1  # derived from seq_len where the rows are read


def test_a_parquet_chat_row_larger_than_the_limit_is_left_out_unrendered(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [json.loads(conversation(n)) for n in (100, 2 * LIMIT, 100)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chats.parquet")
    rendered = spy_on_rendering(monkeypatch)
    cache = chat_loader(tmp_path / "chats.parquet", tmp_path).cache
    assert len(rendered) == 2 and cache.meta["skipped_rows"]["count"] == 1
    assert cache.meta["skipped_rows"]["first"].startswith(f"{tmp_path / 'chats.parquet'}: row 1: its strings hold "
                                                          f"more than {LIMIT} bytes")


def test_a_streamed_chat_row_larger_than_the_limit_is_left_out_unrendered(monkeypatch):
    fake_datasets(monkeypatch, [json.loads(conversation(n)) for n in (100, 100, 2 * LIMIT, 100, 100)])
    rendered = spy_on_rendering(monkeypatch)
    loader = build_dataloader("hf", "fake/chats", "text", CHAT_TOKENIZER, SEQ_LEN, 1, infinite=False,
                              data_format="chat")
    list(loader)
    assert len(rendered) == 4 and loader.packer.skipped == 1


def test_a_dataset_of_only_rows_over_the_limit_names_the_key_to_raise(tmp_path):
    source = tmp_path / "chats.jsonl"
    source.write_text(conversation(2 * LIMIT) + "\n")
    with pytest.raises(DataError, match=r"all its 1 rows .*more than 1040 bytes \(training\.chat_max_row_bytes"):
        chat_loader(source, tmp_path)


# -- long text documents: in pieces, with the ids of one call ----------------------------------------------------------


def long_document(lines: int = 400) -> str:
    words = ["alpha", "beta", "gamma", "  indented", "x=1;", "déjà vu", "42"]
    return "\n".join(" ".join(words[(i + j) % len(words)] for j in range(i % 9 + 1)) for i in range(lines)) + "\n\n"


def spy_on_encode(tok, monkeypatch) -> list[int]:
    calls, real = [], type(tok).encode
    monkeypatch.setattr(type(tok), "encode", lambda self, text: calls.append(len(text)) or real(self, text))
    return calls


@pytest.mark.parametrize("tok", ["byte", "bpe"])
def test_a_long_document_is_tokenized_in_pieces_with_the_ids_of_one_call(tok, tmp_path, monkeypatch):
    if tok == "bpe":
        from tests.unit.test_chat_data import bpe_tokenizer  # byte-level BPE with the Qwen3.5 split and merges
        tok = HFTokenizer(str(bpe_tokenizer(tmp_path / "tok")))
    else:
        tok = ByteTokenizer()
    text = long_document()
    whole = tok.encode(text)
    monkeypatch.setattr(PIECE_CHARS, 256)
    calls = spy_on_encode(tok, monkeypatch)
    ids, _ = TextEncoder(tok)(text)
    bos, eos = ([tok.bos_id] if tok.bos_id is not None else []), ([tok.eos_id] if tok.eos_id is not None else [])
    assert list(ids) == bos + whole + eos
    assert max(calls) < 2 * 256 + 64 and sum(calls) > len(text)  # pieces, and the checks of each cut


class CallPrefixingTokenizer(ByteTokenizer):
    """A tokenizer whose ids depend on where a call starts (as a Metaspace "▁" prefix does): cutting changes them."""

    def encode(self, text):
        return [255] + super().encode(text)


def test_a_tokenizer_whose_ids_change_at_a_cut_gets_the_document_in_one_call(monkeypatch):
    tok = CallPrefixingTokenizer()
    text = long_document()
    monkeypatch.setattr(PIECE_CHARS, 256)
    ids, _ = TextEncoder(tok)(text)
    assert list(ids) == [tok.bos_id] + tok.encode(text) + [tok.eos_id]


def test_a_long_document_in_a_cache_and_a_stream_has_the_ids_of_one_call(tmp_path, monkeypatch):
    monkeypatch.setattr(PIECE_CHARS, 256)
    tok, text = ByteTokenizer(), long_document()
    source = tmp_path / "d.jsonl"
    source.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": text}) + "\n")
    cache = build_dataloader("jsonl", str(source), "text", tok, 16, 1, cache_dir=tmp_path / "cache").cache
    want = [tok.bos_id, *tok.encode("short"), tok.eos_id, tok.bos_id, *tok.encode(text), tok.eos_id]
    assert cache.tokens.tolist() == want and cache.doc_starts.tolist() == [0, 7]
    fake_datasets(monkeypatch, [{"text": "short"}, {"text": text}])
    calls = spy_on_encode(tok, monkeypatch)
    stream = [int(t) for batch in build_dataloader("hf", "fake/corpus", "text", tok, 64, 1, infinite=False)
              for t in batch["input_ids"][0]]
    assert stream == want[:len(stream)] and len(stream) > len(want) - 65 and max(calls) < 2 * 256 + 64


@pytest.mark.parametrize("unit_bytes", [50, 97, 10_000])
def test_rows_over_the_limit_are_left_out_the_same_whatever_the_work_units(tmp_path, unit_bytes):
    """A line passed over unread still moves the reader to the next line, also where it crosses a unit boundary."""
    from harness.data.sources import Row, read_unit, source_units

    rows = [{"messages": f"m{i}", "pad": "x" * (i * 37 % 300)} for i in range(60)]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = [item.value["messages"] if isinstance(item, Row) else item.locate()
           for unit in source_units("jsonl", [source], unit_bytes)
           for item in read_unit("jsonl", unit, "messages", rows=True, max_row_bytes=150)]
    assert got == [r["messages"] if len(json.dumps(r)) <= 150 else f"{source}:{i + 1}" for i, r in enumerate(rows)]
