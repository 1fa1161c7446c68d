"""Bad data, injected for real: every malformed dataset, damaged cache or unfitting data position ends in a DataError
naming the file and line (or byte, row, key, cache folder) at fault, and the run in exit 2 with one `error:` line;
an interrupted cache build leaves no temporary folder. The data contract: docs/design.md ("Packed documents").
The same under two ranks: tests/distributed/test_data_ranks.py."""

from __future__ import annotations

import gzip
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import harness.data.cached
from harness.data import token_cache
from harness.data.loader import DataError, build_dataloader
from harness.data.streamed import StreamPacker
from harness.data.token_cache import META_FILE, STARTS_FILE, TOKENS_FILE
from harness.data.tokenizer import ByteTokenizer
from harness.train import BAD_INPUT, main
from tests.unit.test_data import fake_datasets, random_documents, write_jsonl

REPO = Path(__file__).resolve().parents[2]
FAST = ["--training.steps", "1", "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--metrics.enable_tensorboard", "false", "--checkpoint.export_hf_at_end", "false"]


def build(source: Path, cache_dir: Path, kind: str = "jsonl", tok=None, verify: str = "quick", seq_len: int = 8):
    return build_dataloader(kind, str(source), "text", tok or ByteTokenizer(), seq_len, 1, cache_dir=cache_dir,
                            cache_verify=verify)


def leftovers(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in cache_dir.iterdir()) if cache_dir.exists() else []


# -- malformed sources: one fatal DataError naming file and line, no cache and no temporary folder left --------------


def lines(*rows: str) -> bytes:
    return "".join(row + "\n" for row in rows).encode()


GOOD = json.dumps({"text": "a good document"})
BAD_SOURCES = {  # name: (file name, bytes, kind, the error it must give)
    "invalid_json": ("bad.jsonl", lines(GOOD, GOOD, '{"text": "cut sho'), "jsonl",
                     r"bad\.jsonl:3: not a JSON object \(Unterminated string"),
    "not_utf8": ("bad.jsonl", lines(GOOD) + b'{"text": "caf\xe9"}\n', "jsonl",
                 r"bad\.jsonl:2: not UTF-8 text \(invalid continuation byte at byte 41 of the file\)"),
    "not_utf8_text": ("bad.txt", b"one\n\ntwo\n\n\x80\x81\n", "text", r"bad\.txt:5: not UTF-8 text"),
    "nul_bytes": ("bad.txt", b"one\n\n" + b"\0" * 64, "text", r"bad\.txt:3: a NUL byte at byte 5 of the file"),
    "missing_field": ("bad.jsonl", lines(GOOD, json.dumps({"body": "x", "id": 7})), "jsonl",
                      r"bad\.jsonl:2: no field 'text' \(the row has 'body', 'id'\); set dataset_text_field"),
    "non_string_field": ("bad.jsonl", lines(GOOD, json.dumps({"text": ["a", "b"]})), "jsonl",
                         r"bad\.jsonl:2: field 'text' is a JSON array, not a string"),
    "not_an_object": ("bad.jsonl", lines(GOOD, '"just a string"'), "jsonl",
                      r"bad\.jsonl:2: a JSON string, not an object holding the text field 'text'"),
    "gzip_as_jsonl": ("bad.jsonl", gzip.compress(lines(GOOD) * 50), "jsonl",
                      r"bad\.jsonl:1: not UTF-8 text .*binary or compressed file"),
    "empty_file": ("empty.jsonl", b"", "jsonl", r"jsonl dataset .*empty\.jsonl holds no documents"),
    "blank_lines_only": ("blank.txt", b"\n \n\t\n", "text", r"blank\.txt holds no documents: its files are empty"),
    "all_rows_null": ("null.jsonl", lines(*[json.dumps({"text": None})] * 3), "jsonl",
                      r"holds no documents: all its 3 rows have a null text field or are damaged \(the first: .*null\.jsonl:1\)"),
}


@pytest.mark.parametrize("case", BAD_SOURCES)
def test_a_malformed_source_is_a_data_error_naming_file_and_line(tmp_path, case):
    name, data, kind, message = BAD_SOURCES[case]
    (tmp_path / name).write_bytes(data)
    with pytest.raises(DataError, match=message):
        build(tmp_path / name, tmp_path / "cache", kind)
    assert leftovers(tmp_path / "cache") == []  # nothing cached, no temporary folder


def test_a_folder_without_files_of_the_kind_names_the_folder_and_the_extension(tmp_path):
    (tmp_path / "data" / "sub").mkdir(parents=True)
    for name in ("a.json", "sub/b.json", "c.txt"):
        (tmp_path / "data" / name).write_text("{}")
    with pytest.raises(DataError, match=r"folder .*data holds no \*\.jsonl files, which a jsonl dataset reads "
                                        r"\(recursively\); it holds 2 \.json, 1 \.txt"):
        build(tmp_path / "data", tmp_path / "cache")


def test_a_parquet_file_that_is_not_parquet_is_named(tmp_path):
    pytest.importorskip("pyarrow")
    (tmp_path / "d.parquet").write_bytes(lines(GOOD))
    with pytest.raises(DataError, match=r"d\.parquet: not a readable parquet file"):
        build(tmp_path / "d.parquet", tmp_path / "cache", "parquet")


def test_a_tokenizer_giving_ids_outside_its_vocabulary_fails_the_build(tmp_path):
    class OverflowingTokenizer(ByteTokenizer):  # says 258 ids, gives 300 for "!"
        def encode(self, text):
            return [300 if b == ord("!") else b for b in text.encode()]

    source = write_jsonl(tmp_path / "d.jsonl", ["fine", "loud!"])
    with pytest.raises(DataError, match=r"gave token id 300 for text of .*d\.jsonl, outside its vocabulary of 258"):
        build(source, tmp_path / "cache", tok=OverflowingTokenizer())
    assert leftovers(tmp_path / "cache") == []


def test_a_cache_folder_that_cannot_be_written_is_named(tmp_path):
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    with pytest.raises(DataError, match=r"cannot write the dataset cache under .*cache .*dataset_cache_dir"):
        build(write_jsonl(tmp_path / "d.jsonl", ["abc"]), tmp_path / "cache")


# -- null text: the one row left out, counted and reported -----------------------------------------------------------


def test_rows_with_null_text_are_left_out_counted_and_reported_in_one_line(tmp_path, caplog):
    source = tmp_path / "d.jsonl"
    source.write_bytes(lines(GOOD, json.dumps({"text": None}), GOOD, json.dumps({"text": None, "id": 3})))
    with caplog.at_level(logging.WARNING, logger="harness.data"):
        cache = build(source, tmp_path / "cache").cache
    assert cache.meta["num_documents"] == 2
    assert cache.meta["skipped_rows"] == {"count": 2, "first": f"{source}:2"}
    reports = [r.getMessage() for r in caplog.records if "null text" in r.getMessage()]
    assert reports == [f"data: 2 rows of the dataset have a null text field or are damaged and were left out (the "
                       f"first: {source}:2)"]


def test_parquet_null_rows_are_counted_and_a_non_string_column_is_named(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["alpha", None, "gamma"]}), tmp_path / "d.parquet")
    assert build(tmp_path / "d.parquet", tmp_path / "cache", "parquet").cache.meta["skipped_rows"] == {
        "count": 1, "first": f"{tmp_path / 'd.parquet'}: row 1"}
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match=r"n\.parquet: column 'text' holds int64, not strings"):
        build(tmp_path / "n.parquet", tmp_path / "cache", "parquet")


def test_hf_rows_without_the_field_are_named_and_null_rows_left_out(monkeypatch, caplog):
    fake_datasets(monkeypatch, [{"text": "one"}, {"text": None}, {"text": "two"}, {"body": "three"}])
    loader = build_dataloader("hf", "fake/corpus", "text", ByteTokenizer(), 4, 1, infinite=False)
    with caplog.at_level(logging.WARNING, logger="harness.data"):
        with pytest.raises(DataError, match=r"'fake/corpus' \(dp rank 0 of 1\) row 3: no field 'text' \(the row has "
                                            r"'body'\)"):
            list(loader)
    assert any("left out 1 rows with a null text field" in r.getMessage() for r in caplog.records)


# -- damaged caches: the quick check on every open, the full one on request -----------------------------------------


def flip_tokens_in_vocabulary(folder: Path) -> None:
    tokens = np.fromfile(folder / TOKENS_FILE, dtype=np.uint32)
    np.random.default_rng(0).integers(0, 258, tokens.size, dtype=np.uint32).tofile(folder / TOKENS_FILE)


def set_token(folder: Path, index: int, value: int) -> None:
    tokens = np.memmap(folder / TOKENS_FILE, dtype=np.uint32, mode="r+")
    tokens[index] = value
    tokens.flush()


def edit_starts(folder: Path, edit) -> None:
    starts = np.memmap(folder / STARTS_FILE, dtype=np.int64, mode="r+")
    edit(starts)
    starts.flush()


def edit_meta(folder: Path, edit) -> None:
    path = folder / META_FILE
    path.write_text(edit(path.read_text()))


def swap(starts, i, j):
    starts[i], starts[j] = int(starts[j]), int(starts[i])


DAMAGE = {  # name: (what is done to a cache of 40 documents, the error it must give)
    "tokens_garbage_in_vocabulary": (flip_tokens_in_vocabulary, "tokens.bin does not match the sha256 of its sample"),
    "token_outside_vocabulary": (lambda f: set_token(f, 17, 70_000),
                                 "tokens.bin holds token id 70000, outside the tokenizer's vocabulary of 258"),
    "doc_starts_garbage": (lambda f: (f / STARTS_FILE).write_bytes(os.urandom((f / STARTS_FILE).stat().st_size)),
                           "doc_starts.bin does not increase|doc_starts.bin runs from"),
    "doc_starts_swapped": (lambda f: edit_starts(f, lambda s: swap(s, 3, 4)),
                           r"doc_starts.bin does not increase at document 4 \(offset \d+ then \d+\)"),
    "doc_start_shifted": (lambda f: edit_starts(f, lambda s: s.__setitem__(5, s[5] + 1)),
                          "doc_starts.bin does not match its sha256"),
    "doc_start_past_the_end": (lambda f: edit_starts(f, lambda s: s.__setitem__(-1, 10**9)),
                               r"doc_starts.bin runs from 0 to 1000000000, not from 0 to below the \d+ tokens"),
    "meta_value_edited": (lambda f: edit_meta(f, lambda t: t.replace('"token_max": 257', '"token_max": 256')),
                          "its meta.json does not match its checksum"),
    "meta_cut_short": (lambda f: edit_meta(f, lambda t: t[: len(t) // 2]), "its meta.json is unreadable"),
    "meta_not_an_object": (lambda f: edit_meta(f, lambda t: "[]"), "its meta.json does not match its checksum"),
    "doc_starts_missing": (lambda f: (f / STARTS_FILE).unlink(), "doc_starts.bin is missing"),
    "meta_of_another_cache": (lambda f: edit_meta(f, lambda t: _resealed(t, key="jsonl-v2-other")),
                              "its meta.json belongs to the cache jsonl-v2-other"),
}


def _resealed(text: str, **changes) -> str:
    """meta.json with `changes`, and a checksum that fits them: a self-consistent meta of another cache."""
    meta = {**json.loads(text), **changes}
    meta["checksum"] = token_cache._meta_checksum(meta)
    return json.dumps(meta)


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_cache_is_a_data_error_naming_the_folder_and_what_failed(tmp_path, case):
    damage, message = DAMAGE[case]
    source = write_jsonl(tmp_path / "d.jsonl", random_documents(40))
    folder = build(source, tmp_path / "cache").cache.folder
    damage(folder)
    with pytest.raises(DataError, match=rf"dataset cache {folder} is damaged: ({message}).*Delete the folder "
                                        rf"\(rm -r {folder}\) and the next run rebuilds it"):
        build(source, tmp_path / "cache")


def test_the_quick_check_samples_a_large_cache_and_the_full_check_and_each_row_read_catch_the_rest(tmp_path,
                                                                                                    monkeypatch):
    # A cache larger than its sample: 4 blocks of 8 tokens out of ~800 (a real one: 64 blocks of 65,536 tokens).
    monkeypatch.setattr(token_cache, "SAMPLE_BLOCKS", 4)
    monkeypatch.setattr(token_cache, "SAMPLE_BLOCK_TOKENS", 8)
    source = write_jsonl(tmp_path / "d.jsonl", random_documents(40))
    cache = build(source, tmp_path / "cache").cache
    sampled = token_cache._sample_ranges(len(cache.tokens), 4, 8)
    assert sampled[0] == (0, 8) and sampled[-1][1] == len(cache.tokens) and len(sampled) == 4
    outside = 100  # in no sampled block: row 12 of seq_len 8
    assert all(not lo <= outside < hi for lo, hi in sampled)
    set_token(cache.folder, outside, int(cache.tokens[outside]) ^ 1)  # still inside the vocabulary
    build(source, tmp_path / "cache")  # the quick check does not read it ...
    with pytest.raises(DataError, match="tokens.bin does not match its sha256 in meta.json"):
        build(source, tmp_path / "cache", verify="full")  # ... the full one does
    set_token(cache.folder, outside, 9_999)  # outside the vocabulary, outside the sample
    loader = build(source, tmp_path / "cache")
    loader.next_row = 12
    with pytest.raises(DataError, match=rf"dataset cache {cache.folder} is damaged: row 12 \(tokens 96..104\) holds "
                                        r"token id 9999, outside the tokenizer's vocabulary of 258"):
        next(loader)


def recorded_verify_modes(monkeypatch) -> list[str]:
    """The `verify` mode of every open of a dataset cache from now on, in order."""
    modes = []
    real_open = token_cache.open_cache
    monkeypatch.setattr(token_cache, "open_cache", lambda folder, vocab, verify: modes.append(verify) or
                        real_open(folder, vocab, verify))
    return modes


def test_a_fresh_build_is_checked_in_full(tmp_path, monkeypatch):
    modes = recorded_verify_modes(monkeypatch)
    source = write_jsonl(tmp_path / "d.jsonl", random_documents(10))
    build(source, tmp_path / "cache")
    build(source, tmp_path / "cache")
    assert modes == ["full", "quick"]


def test_an_interrupted_build_removes_its_temporary_folder(tmp_path, monkeypatch):
    source = write_jsonl(tmp_path / "d.jsonl", random_documents(30))

    def interrupted(kind, unit, text_field="text"):
        yield "a first document"
        raise KeyboardInterrupt  # what Ctrl-C, or SIGTERM under harness/train.py, raises mid-build

    monkeypatch.setattr(harness.data.cached, "read_unit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build(source, tmp_path / "cache")
    assert leftovers(tmp_path / "cache") == []


# -- a data position that does not fit the data ------------------------------------------------------------------------


def test_a_saved_position_that_does_not_fit_is_a_data_error(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", random_documents(40))
    loader = build(source, tmp_path / "cache", seq_len=16)
    state = loader.state_dict()
    for bad, message in [({**state, "next_row": "12"}, r"next_row='12' where a int belongs"),
                         ({k: v for k, v in state.items() if k != "stream_id"}, "stream_id=None"),
                         ({**state, "seq_len": 8}, "rows of seq_len 8, this run has seq_len 16"),
                         ({**state, "stream_id": "0" * 16}, "in another dataset"),
                         ({**state, "next_row": -4}, "negative"),
                         (StreamPacker(lambda: [], ByteTokenizer(), 16, 1).state_dict(), "streamed"),
                         (None, "no 'next_row'")]:
        with pytest.raises(DataError, match=message):
            loader.load_state_dict(bad)
    packer = StreamPacker(lambda: [], ByteTokenizer(), 16, 1)
    with pytest.raises(DataError, match="local \\(cached\\) dataset"):
        packer.load_state_dict(state)
    with pytest.raises(DataError, match="doc_index=None"):
        packer.load_state_dict({**packer.state_dict(), "doc_index": None})


# -- through the entry point: exit 2, one `error:` line, no traceback ------------------------------------------------


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    return errors[0]


def test_train_on_an_invalid_json_line_exits_2_with_one_line_naming_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(lines(GOOD, GOOD, "{oops"))
    result = subprocess.run([sys.executable, "-m", "harness.train", *FAST, "--training.dataset_path", str(bad),
                             "--job.dump_folder", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == BAD_INPUT, result.stderr
    assert one_error_line(result.stderr).startswith(f"error: {bad}:3: not a JSON object")


def test_train_on_a_damaged_cache_exits_2_with_one_line(tmp_path, capsys):
    cache_dir = tmp_path / "out" / "dataset_cache"  # where the run below looks: the same dataset and tokenizer
    folder = build(REPO / "data" / "debug_corpus" / "train.jsonl", cache_dir).cache.folder
    edit_starts(folder, lambda s: swap(s, 10, 11))
    assert main([*FAST, "--job.dump_folder", str(tmp_path / "out")]) == BAD_INPUT
    assert one_error_line(capsys.readouterr().err).startswith(f"error: dataset cache {folder} is damaged: "
                                                              f"doc_starts.bin does not increase at document 11")


# A slow tokenizer, so that SIGTERM surely comes while the cache is being built; the rest is harness.train as is.
SLOW_TRAIN = """import runpy, time
from harness.data.tokenizer import ByteTokenizer
encode = ByteTokenizer.encode
ByteTokenizer.encode = lambda self, text: time.sleep(0.002) or encode(self, text)
runpy.run_module("harness.train", run_name="__main__")"""


def test_sigterm_during_the_cache_build_removes_the_temporary_folder_and_says_so_in_one_line(tmp_path):
    cache_dir = tmp_path / "out" / "dataset_cache"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_TRAIN, *FAST, "--job.dump_folder", str(tmp_path / "out")],
                            cwd=REPO, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not list(cache_dir.glob(".*.tmp-*/part-*")):  # the build has begun writing
        assert proc.poll() is None and time.monotonic() < deadline, "no cache build seen"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 143, stderr
    assert "Traceback" not in stderr and stderr.splitlines()[-1] == "stopped on SIGTERM while starting; nothing saved"
    assert leftovers(cache_dir) == []


def test_the_trainer_opens_its_cache_as_training_dataset_cache_verify_says(tmp_path, monkeypatch):
    from harness.train import main

    modes = recorded_verify_modes(monkeypatch)
    source = write_jsonl(tmp_path / "d.jsonl", random_documents(40))
    flags = ["--training.dataset_path", str(source), "--training.seq_len", "32", "--training.local_batch_size", "2",
             "--training.steps", "1", "--metrics.enable_tensorboard", "false", "--checkpoint.export_hf_at_end", "false",
             "--job.dump_folder", str(tmp_path / "out")]
    assert main(flags) == 0  # a fresh build: checked in full
    assert main([*flags, "--training.steps", "2"]) == 0  # resumes nothing (no checkpoints); the cache exists
    assert main([*flags, "--training.steps", "2", "--training.dataset_cache_verify", "full"]) == 0
    assert modes == ["full", "quick", "full"]
