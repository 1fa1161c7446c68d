"""Tokenizers, document sources and packing: the data contract of DESIGN.md ("Packed documents")."""

import json
import pickle
import random
from pathlib import Path

import pytest
import torch

from harness.data import IGNORE_INDEX, PackedDataLoader, build_dataloader, open_documents
from harness.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer

REPO = Path(__file__).resolve().parents[2]
DEBUG_CORPUS = REPO / "data" / "debug_corpus" / "train.jsonl"


class NoSpecialsTokenizer(ByteTokenizer):
    """Like many HF tokenizers without BOS: boundaries must come from the packer, not from token ids."""

    bos_id = None
    eos_id = None


def random_documents(n: int, seed: int = 0) -> list[str]:
    r = random.Random(seed)
    return ["".join(r.choice("abcdefgh ") for _ in range(r.randint(1, 40))) for _ in range(n)]


def expected_stream(docs: list[str], tok) -> tuple[list[int], list[bool]]:
    tokens, starts = [], []
    for doc in docs:
        ids = ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(doc)
        ids += [tok.eos_id] if tok.eos_id is not None else []
        tokens += ids
        starts += [True] + [False] * (len(ids) - 1)
    return tokens, starts


def take(loader, n: int) -> list[dict]:
    return [next(loader) for _ in range(n)]


# -- tokenizers ----------------------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_utf8_and_decode_skips_specials():
    tok = ByteTokenizer()
    text = "Hello, wörld! 你好"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and tok.vocab_size == 258
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id]) == text
    assert build_tokenizer("").__class__ is ByteTokenizer


def make_word_level_tokenizer(folder: Path, config: dict | None) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))


def test_hf_tokenizer_folder_loads_with_bos_eos_from_tokenizer_config(tmp_path):
    make_word_level_tokenizer(tmp_path, {"bos_token": "<s>", "eos_token": {"content": "</s>"}})
    tok = build_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (5, 1, 2)
    assert tok.encode("hello world hello") == [3, 4, 3]  # no specials added by encode
    assert tok.decode([1, 3, 4, 2]) == "hello world"


def test_hf_tokenizer_file_without_config_has_no_specials(tmp_path):
    make_word_level_tokenizer(tmp_path, None)
    tok = HFTokenizer(str(tmp_path / "tokenizer.json"))
    assert (tok.bos_id, tok.eos_id) == (None, None)
    assert tok.encode("world") == [4]


def test_missing_tokenizer_raises_file_not_found_naming_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        build_tokenizer(str(tmp_path / "nope"))


# -- sources -------------------------------------------------------------------------------------------------------


def test_text_source_splits_documents_on_blank_lines_across_a_folder(tmp_path):
    (tmp_path / "a.txt").write_text("first doc\nstill first\n\n\nsecond doc\n")
    (tmp_path / "b.txt").write_text("\nthird doc\n  \nfourth doc")
    (tmp_path / "ignored.md").write_text("not a text source file")
    assert list(open_documents("text", str(tmp_path))) == [
        "first doc\nstill first", "second doc", "third doc", "fourth doc"]


def test_jsonl_source_yields_the_configured_text_field(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"content": "one", "id": 1}\n\n{"content": "two"}\n')
    assert list(open_documents("jsonl", str(f), text_field="content")) == ["one", "two"]


def test_parquet_source_yields_the_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["alpha", "beta", "gamma"], "n": [1, 2, 3]}), tmp_path / "d.parquet")
    assert list(open_documents("parquet", str(tmp_path))) == ["alpha", "beta", "gamma"]


def test_missing_dataset_path_raises_file_not_found_naming_it(tmp_path):
    missing = tmp_path / "no_such.jsonl"
    with pytest.raises(FileNotFoundError, match="no_such.jsonl"):
        open_documents("jsonl", str(missing))
    with pytest.raises(FileNotFoundError, match="no_such.jsonl"):
        build_dataloader("jsonl", str(missing), "text", ByteTokenizer(), 8, 1)


def test_jsonl_line_without_text_field_or_bad_json_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: .*'text'"):
        list(open_documents("jsonl", str(f)))
    f.write_text('{"text": "ok"}\n\n{"text": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: not a JSON object"):
        list(open_documents("jsonl", str(f)))


def test_unknown_source_kind_or_empty_path_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset kind 'csv'"):
        open_documents("csv", str(tmp_path))
    with pytest.raises(ValueError, match="empty dataset path"):
        open_documents("text", "")


# -- packing -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tok", [ByteTokenizer(), NoSpecialsTokenizer()], ids=["bos_eos", "no_specials"])
def test_packing_keeps_document_boundaries_and_every_token_in_order(tok):
    docs = random_documents(60)
    L, B = 16, 3
    loader = PackedDataLoader(lambda: docs, tok, seq_len=L, batch_size=B, infinite=False)
    batches = list(loader)
    tokens, starts = expected_stream(docs, tok)
    rows = len(batches) * B
    assert rows == (len(tokens) - 1) // L // B * B  # only the last partial batch is dropped
    for b in batches:
        assert all(v.shape == (B, L) and v.dtype == torch.int64 for v in b.values())
    inputs = torch.cat([b["input_ids"].flatten() for b in batches]).tolist()
    labels = torch.cat([b["labels"].flatten() for b in batches]).tolist()
    positions = torch.cat([b["position_ids"].flatten() for b in batches]).tolist()
    n = rows * L
    assert inputs == tokens[:n]  # rows continue the stream; every token is an input once, in order
    for i in range(n):
        crosses = starts[i + 1]  # the next token opens another document
        assert labels[i] == (IGNORE_INDEX if crosses else tokens[i + 1]), i
        restart = starts[i] or i % L == 0  # document start, or row start (treated as a document start)
        assert positions[i] == (0 if restart else positions[i - 1] + 1), i


def rank_documents(docs: list[str], rank: int, world: int) -> list[str]:
    # seq_len 1, batch 1: rows are stream[k:k+2], so the inputs are the whole stream but its last token (eos).
    tok = ByteTokenizer()
    loader = PackedDataLoader(lambda: docs, tok, 1, 1, dp_rank=rank, dp_world_size=world, infinite=False)
    stream = [int(b["input_ids"]) for b in loader] + [tok.eos_id]
    text = bytes(i if i < 256 else ord("|") for i in stream).decode()
    return [d for d in text.split("|") if d]


def test_two_dp_ranks_read_disjoint_documents_that_together_cover_the_dataset():
    docs = [f"doc{i}" for i in range(11)]
    shards = [rank_documents(docs, r, 2) for r in range(2)]
    assert shards[0] == docs[0::2] and shards[1] == docs[1::2]
    assert not set(shards[0]) & set(shards[1]) and sorted(shards[0] + shards[1]) == sorted(docs)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("k", [0, 1, 5, 13])  # 13 batches run past an epoch boundary
def test_resume_from_state_dict_yields_identical_next_batches(k, rank):
    docs = random_documents(25, seed=1)
    make = lambda: PackedDataLoader(lambda: iter(docs), ByteTokenizer(), 24, 2, dp_rank=rank, dp_world_size=2)
    uninterrupted = make()
    take(uninterrupted, k)
    state = pickle.loads(pickle.dumps(uninterrupted.state_dict()))
    json.dumps(state)  # plain ints and lists
    expected = take(uninterrupted, 6)
    resumed = make()
    resumed.load_state_dict(state)
    for want, got in zip(expected, take(resumed, 6)):
        for key in want:
            assert torch.equal(want[key], got[key]), key
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_infinite_loader_starts_new_epochs_and_finite_loader_stops():
    docs = random_documents(5)
    infinite = PackedDataLoader(lambda: docs, ByteTokenizer(), 32, 2)
    take(infinite, 20)
    assert infinite.epoch >= 2
    assert len(list(PackedDataLoader(lambda: docs, ByteTokenizer(), 32, 2, infinite=False))) < 20


def test_rank_without_documents_and_mismatched_resume_are_clear_errors():
    with pytest.raises(ValueError, match="fewer documents than data-parallel ranks"):
        next(PackedDataLoader(lambda: ["only one"], ByteTokenizer(), 8, 1, dp_rank=1, dp_world_size=2))
    state = PackedDataLoader(lambda: ["a"], ByteTokenizer(), 8, 1).state_dict()
    with pytest.raises(ValueError, match="same data-parallel degree"):
        PackedDataLoader(lambda: ["a"], ByteTokenizer(), 8, 1, dp_rank=1, dp_world_size=4).load_state_dict(state)


# -- shipped data --------------------------------------------------------------------------------------------------


def test_shipped_debug_corpus_exists_is_at_most_2mb_and_loads():
    assert DEBUG_CORPUS.is_file(), "run scripts/make_debug_corpus.py"
    assert DEBUG_CORPUS.stat().st_size <= 2 * 1024 * 1024
    assert (DEBUG_CORPUS.parent / "README.md").is_file()
    loader = build_dataloader("jsonl", str(DEBUG_CORPUS), "text", ByteTokenizer(), seq_len=256, batch_size=2)
    batch = next(loader)
    assert batch["input_ids"].shape == (2, 256)
    assert batch["input_ids"][0, 0] == ByteTokenizer.bos_id and batch["position_ids"][0, 0] == 0
