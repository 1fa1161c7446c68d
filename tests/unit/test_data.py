"""Tokenizers, document sources, work units, packed global rows, resume and hf prefetching: the data contract of
docs/design.md ("Packed documents"). Cache files and reuse: test_token_cache.py."""

import json
import pickle
import random
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from harness.data.loader import IGNORE_INDEX, DataError, build_dataloader
from harness.data.prefetch import PrefetchingLoader
from harness.data.sources import read_unit, source_units
from harness.data.streamed import StreamPacker
from harness.data.tokenizer import ByteTokenizer, HFTokenizer, build_tokenizer
from tests.runs import open_documents

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
        if ids:  # an empty document without specials leaves no trace
            tokens += ids
            starts += [True] + [False] * (len(ids) - 1)
    return tokens, starts


def expected_rows(docs: list[str], tok, L: int) -> list[dict[str, list[int]]]:
    """Every full row of the packed stream, written out from the contract (not from harness/data/rows.py)."""
    tokens, starts = expected_stream(docs, tok)
    rows = []
    for k in range((len(tokens) - 1) // L):
        lo = k * L
        labels = [IGNORE_INDEX if starts[lo + i + 1] else tokens[lo + i + 1] for i in range(L)]
        positions = []
        for i in range(L):
            restart = i == 0 or starts[lo + i]  # row start or document start
            positions.append(0 if restart else positions[-1] + 1)
        rows.append({"input_ids": tokens[lo: lo + L], "labels": labels, "position_ids": positions})
    return rows


def batch_rows(batch: dict) -> list[dict[str, list[int]]]:
    for v in batch.values():
        assert v.dtype == torch.int64 and v.shape == batch["input_ids"].shape
    return [{key: batch[key][j].tolist() for key in batch} for j in range(batch["input_ids"].shape[0])]


def write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def cached_loader(source: Path, tmp_path: Path, seq_len: int, batch_size: int, rank: int = 0, world: int = 1,
                  tok=None, infinite: bool = True):
    return build_dataloader("jsonl", str(source), "text", tok or ByteTokenizer(), seq_len, batch_size, dp_rank=rank,
                            dp_world_size=world, cache_dir=tmp_path / "cache", infinite=infinite)


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


def test_missing_dataset_path_is_a_data_error_naming_it(tmp_path):
    missing = tmp_path / "no_such.jsonl"
    with pytest.raises(DataError, match="no_such.jsonl"):
        open_documents("jsonl", str(missing))
    with pytest.raises(DataError, match="no_such.jsonl"):
        build_dataloader("jsonl", str(missing), "text", ByteTokenizer(), 8, 1)


def test_jsonl_line_without_text_field_or_bad_json_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: no field 'text' \(the row has 'body'\)"):
        list(open_documents("jsonl", str(f)))
    f.write_text('{"text": "ok"}\n\n{"text": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: not a JSON object"):
        list(open_documents("jsonl", str(f)))


def test_unknown_source_kind_or_empty_path_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset kind 'csv'"):
        open_documents("csv", str(tmp_path))
    with pytest.raises(ValueError, match="empty dataset path"):
        open_documents("text", "")



# -- work units: files cut into byte ranges read the same documents ------------------------------------------------


def read_in_units(kind: str, file: Path, unit_bytes: int) -> list[str]:
    units = source_units(kind, [file], unit_bytes)
    assert len(units) == -(-file.stat().st_size // unit_bytes)  # the cuts depend on the file size only
    return [doc for unit in units for doc in read_unit(kind, unit)]


def test_jsonl_cut_into_small_byte_ranges_reads_every_document_once_in_order(tmp_path):
    docs = [d + "é" * (i % 3) for i, d in enumerate(random_documents(30, seed=2))]
    f = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": d}, ensure_ascii=False) for d in docs]
    f.write_bytes("".join(line + ("\r\n" if i % 4 == 0 else "\n") + ("\n" if i % 5 == 0 else "")
                          for i, line in enumerate(lines)).encode())
    assert list(open_documents("jsonl", str(f))) == docs
    for unit_bytes in (1, 2, 7, 31, 100, 10_000):  # cuts inside lines, at line ends, inside UTF-8 characters
        assert read_in_units("jsonl", f, unit_bytes) == docs, unit_bytes


def test_text_cut_into_small_byte_ranges_keeps_the_blank_line_rules(tmp_path):
    f = tmp_path / "d.txt"
    # Leading blank lines, whitespace-only separators, runs of blanks, CRLF and a lone CR, no final newline.
    f.write_bytes(b"\n  \nalpha one\nalpha two\n\n \t\n\nbeta\r\n\r\ngamma\rgamma 2\r\rdelta\n\n\n\xc3\xa9psilon\nlast")
    docs = ["alpha one\nalpha two", "beta", "gamma\ngamma 2", "delta", "épsilon\nlast"]
    assert list(open_documents("text", str(f))) == docs
    for unit_bytes in range(1, f.stat().st_size + 1):
        assert read_in_units("text", f, unit_bytes) == docs, unit_bytes


def test_errors_in_later_byte_ranges_still_name_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    good = [json.dumps({"text": f"document {i}"}) for i in range(30)]
    f.write_text("\n".join(good[:20] + [""] + good[20:26] + ['{"text": '] + good[26:]) + "\n")  # bad: line 28
    with pytest.raises(ValueError, match=r"bad\.jsonl:28: not a JSON object"):
        read_in_units("jsonl", f, 64)
    f.write_text("\n".join(good[:9] + ['{"body": "no text"}'] + good[9:]) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:10: no field 'text'"):
        read_in_units("jsonl", f, 50)
    t = tmp_path / "bad.txt"
    t.write_bytes(b"one\n\ntwo\r\nthree\n\nfour\n\xff\n")  # not UTF-8 on line 7
    with pytest.raises(ValueError, match=r"bad\.txt:7: not UTF-8"):
        read_in_units("text", t, 5)


# -- global rows from the token cache ------------------------------------------------------------------------------


@pytest.mark.parametrize("tok", [ByteTokenizer(), NoSpecialsTokenizer()], ids=["bos_eos", "no_specials"])
def test_cached_rows_keep_document_boundaries_and_every_token_in_order(tmp_path, tok):
    docs = random_documents(60)
    docs[7] = docs[30] = ""  # empty documents: only their specials (if any) enter the stream
    L, B = 16, 3
    loader = cached_loader(write_jsonl(tmp_path / "d.jsonl", docs), tmp_path, L, B, tok=tok, infinite=False)
    rows = [row for batch in loader for row in batch_rows(batch)]
    want = expected_rows(docs, tok, L)
    assert len(rows) == len(want) // B * B  # only the last partial batch is dropped
    assert rows == want[: len(rows)]


def test_global_rows_do_not_depend_on_the_data_parallel_degree(tmp_path):
    docs = random_documents(120, seed=3)
    source, L, global_batch = write_jsonl(tmp_path / "d.jsonl", docs), 16, 8
    want = expected_rows(docs, ByteTokenizer(), L)
    per_world = {}
    for world in (1, 2, 4):
        b = global_batch // world
        loaders = [cached_loader(source, tmp_path, L, b, rank=r, world=world) for r in range(world)]
        micro_batches = []
        for m in range(4):
            union = []
            for r, loader in enumerate(loaders):
                rows = batch_rows(next(loader))
                assert rows == [want[m * global_batch + r + j * world] for j in range(b)], (world, m, r)
                union += [tuple(row["input_ids"]) for row in rows]
            micro_batches.append(sorted(union))
        per_world[world] = micro_batches
    assert per_world[1] == per_world[2] == per_world[4]


@pytest.mark.parametrize("k", [0, 1, 5, 13])  # 13 batches run past the end of the rows (epoch 2)
def test_resume_from_state_dict_yields_identical_next_batches(tmp_path, k):
    source = write_jsonl(tmp_path / "d.jsonl", random_documents(25, seed=1))
    make = lambda: cached_loader(source, tmp_path, 24, 2)
    uninterrupted = make()
    take(uninterrupted, k)
    state = pickle.loads(pickle.dumps(uninterrupted.state_dict()))
    json.dumps(state)  # plain ints and strings
    expected = take(uninterrupted, 6)
    resumed = make()
    resumed.load_state_dict(state)
    for want, got in zip(expected, take(resumed, 6)):
        for key in want:
            assert torch.equal(want[key], got[key]), key
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_state_of_two_ranks_resumes_on_one_rank_and_on_four_ranks(tmp_path):
    docs = random_documents(80, seed=4)
    source, L = write_jsonl(tmp_path / "d.jsonl", docs), 16
    want = expected_rows(docs, ByteTokenizer(), L)
    two = [cached_loader(source, tmp_path, L, 2, rank=r, world=2) for r in range(2)]
    for loader in two:
        take(loader, 3)  # 3 global micro-batches of 4 rows: rows 0..11 consumed
    state = two[0].state_dict()
    assert two[1].state_dict() == state  # one global state: any rank's checkpoint will do

    one = cached_loader(source, tmp_path, L, 4)
    one.load_state_dict(state)
    assert batch_rows(next(one)) == want[12:16]
    four = [cached_loader(source, tmp_path, L, 1, rank=r, world=4) for r in range(4)]
    for r, loader in enumerate(four):
        loader.load_state_dict(state)
        assert batch_rows(next(loader)) == [want[12 + r]]
    odd = cached_loader(source, tmp_path, L, 3)  # a global batch that does not divide 12 rows
    odd.load_state_dict(state)
    assert batch_rows(next(odd)) == want[12:15]


def test_state_resumes_on_a_copy_of_the_dataset_at_another_path(tmp_path):
    docs = random_documents(40, seed=5)
    first = cached_loader(write_jsonl(tmp_path / "a.jsonl", docs), tmp_path, 16, 2)
    take(first, 3)
    copy = cached_loader(write_jsonl(tmp_path / "copy.jsonl", docs), tmp_path, 16, 2)
    assert copy.cache.folder != first.cache.folder  # another source identity, another cache
    copy.load_state_dict(first.state_dict())  # the same token stream: the position carries over
    assert batch_rows(next(copy)) == batch_rows(next(first))


def test_infinite_loader_wraps_to_row_zero_and_finite_loader_stops(tmp_path):
    docs = random_documents(5)
    source, L = write_jsonl(tmp_path / "d.jsonl", docs), 32
    want = expected_rows(docs, ByteTokenizer(), L)
    infinite = cached_loader(source, tmp_path, L, 1)
    rows = [batch_rows(b)[0] for b in take(infinite, 2 * len(want) + 1)]
    assert rows == want + want + want[:1]
    assert infinite.epoch == 2
    finite = cached_loader(source, tmp_path, L, 2, infinite=False)
    assert [row for b in finite for row in batch_rows(b)] == want[: len(want) // 2 * 2]
    with pytest.raises(StopIteration):
        next(finite)


def test_state_from_another_seq_len_tokenizer_or_dataset_is_rejected(tmp_path):
    docs = random_documents(40, seed=6)
    source = write_jsonl(tmp_path / "d.jsonl", docs)
    state = cached_loader(source, tmp_path, 16, 2).state_dict()
    with pytest.raises(ValueError, match="seq_len 16, this run has seq_len 8"):
        cached_loader(source, tmp_path, 8, 2).load_state_dict(state)
    with pytest.raises(ValueError, match="another tokenizer"):
        cached_loader(source, tmp_path, 16, 2, tok=NoSpecialsTokenizer()).load_state_dict(state)
    other = write_jsonl(tmp_path / "other.jsonl", docs[1:])
    with pytest.raises(ValueError, match="another dataset"):
        cached_loader(other, tmp_path, 16, 2).load_state_dict(state)
    stream_state = StreamPacker(lambda: docs, ByteTokenizer(), 16, 2).state_dict()
    with pytest.raises(ValueError, match="streamed"):
        cached_loader(source, tmp_path, 16, 2).load_state_dict(stream_state)


def test_local_dataset_without_cache_dir_or_with_too_few_tokens_is_rejected(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", ["tiny"])
    with pytest.raises(ValueError, match="cache_dir is needed"):
        build_dataloader("jsonl", str(source), "text", ByteTokenizer(), 8, 1)
    with pytest.raises(ValueError, match="too few for one row of seq_len 8"):
        cached_loader(source, tmp_path, 8, 1)  # bos + 4 bytes + eos = 6 tokens < 9


# -- hf streams: per-rank packing in a prefetch thread ------------------------------------------------------------


def stream_loader(docs, seq_len=16, batch_size=2, rank=0, world=1, infinite=True, depth=4) -> PrefetchingLoader:
    packer = StreamPacker(lambda: iter(docs), ByteTokenizer(), seq_len, batch_size, rank, world, infinite)
    return PrefetchingLoader(packer, depth)


def test_stream_loader_keeps_the_packing_contract():
    docs = random_documents(60, seed=7)
    rows = [row for batch in stream_loader(docs, 16, 3, infinite=False) for row in batch_rows(batch)]
    want = expected_rows(docs, ByteTokenizer(), 16)
    assert len(rows) == len(want) // 3 * 3 and rows == want[: len(rows)]


def assert_same_batches(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for key in w:
            assert torch.equal(g[key], w[key]), key


@pytest.mark.parametrize("k", [1, 5, 13])  # 13 batches run past an epoch boundary
def test_prefetching_state_is_that_of_the_consumed_batches_not_the_prefetched_ones(k):
    docs = random_documents(25, seed=1)
    reference = take(stream_loader(docs, 24, 2), k + 6)
    loader = stream_loader(docs, 24, 2)
    take(loader, k)
    deadline = time.monotonic() + 10
    while not loader._queue.full():  # let the thread run ahead: its packer is now past the consumer
        assert time.monotonic() < deadline, "the prefetch thread did not fill its queue"
        time.sleep(0.01)
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    loader.close()  # drops the prefetched batches: they are packed again
    assert_same_batches(take(loader, 6), reference[k:])
    resumed = stream_loader(docs, 24, 2)
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 6), reference[k:])
    loader.close()
    resumed.close()


def test_prefetch_thread_error_is_raised_by_next():
    def documents():
        yield from random_documents(10)
        raise ValueError("row 10: no field 'text'")

    loader = PrefetchingLoader(StreamPacker(documents, ByteTokenizer(), 16, 2))
    with pytest.raises(ValueError, match="row 10: no field 'text'"):
        take(loader, 100)
    with pytest.raises(ValueError, match="row 10"):  # and again: the loader does not hang on a dead thread
        next(loader)


def fake_datasets(monkeypatch, rows: list[dict]) -> list[tuple[int, int]]:
    """Installs a stand-in `datasets` package; returns the (rank, world_size) of each split_dataset_by_node."""
    splits = []

    def split_dataset_by_node(ds, rank, world_size):
        splits.append((rank, world_size))
        return ds[rank::world_size]

    datasets = types.ModuleType("datasets")
    datasets.load_dataset = lambda name, split, streaming: rows
    datasets.distributed = types.ModuleType("datasets.distributed")
    datasets.distributed.split_dataset_by_node = split_dataset_by_node
    monkeypatch.setitem(sys.modules, "datasets", datasets)
    monkeypatch.setitem(sys.modules, "datasets.distributed", datasets.distributed)
    return splits


def hf_rank_documents(rank: int, world: int) -> list[str]:
    # seq_len 1, batch 1: rows are stream[k:k+2], so the inputs are the whole stream but its last token (eos).
    tok = ByteTokenizer()
    loader = build_dataloader("hf", "fake/corpus", "text", tok, 1, 1, dp_rank=rank, dp_world_size=world,
                              infinite=False)
    stream = [int(b["input_ids"]) for b in loader] + [tok.eos_id]
    text = bytes(i if i < 256 else ord("|") for i in stream).decode()
    return [d for d in text.split("|") if d]


def test_hf_stream_reads_only_its_shard_through_split_dataset_by_node(monkeypatch):
    docs = [f"doc{i}" for i in range(11)]
    splits = fake_datasets(monkeypatch, [{"text": d} for d in docs])
    assert hf_rank_documents(1, 2) == docs[1::2] and splits == [(1, 2)]
    assert hf_rank_documents(0, 1) == docs and splits == [(1, 2)]  # one rank reads the whole stream


def test_hf_rank_without_documents_and_mismatched_resume_are_clear_errors(monkeypatch):
    fake_datasets(monkeypatch, [{"text": "only one"}])
    with pytest.raises(ValueError, match="fewer documents"):
        next(build_dataloader("hf", "fake/corpus", "text", ByteTokenizer(), 8, 1, dp_rank=1, dp_world_size=2))
    state = stream_loader(["a"], 8, 1).state_dict()
    with pytest.raises(ValueError, match="same data-parallel degree"):
        stream_loader(["a"], 8, 1, rank=1, world=4).load_state_dict(state)


# -- shipped data --------------------------------------------------------------------------------------------------


def test_shipped_debug_corpus_exists_is_at_most_2mb_and_loads(tmp_path):
    assert DEBUG_CORPUS.is_file(), "run scripts/make_debug_corpus.py"
    assert DEBUG_CORPUS.stat().st_size <= 2 * 1024 * 1024
    assert (DEBUG_CORPUS.parent / "README.md").is_file()
    loader = build_dataloader("jsonl", str(DEBUG_CORPUS), "text", ByteTokenizer(), seq_len=256, batch_size=2,
                              cache_dir=tmp_path / "cache")
    batch = next(loader)
    assert batch["input_ids"].shape == (2, 256)
    assert batch["input_ids"][0, 0] == ByteTokenizer.bos_id and batch["position_ids"][0, 0] == 0
