"""The token cache of local datasets: layout, reuse, invalidation, atomic publication, damage (harness/data/token_cache.py).
The rows read from it: test_data.py."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import harness.data.cached
from harness.data.loader import DataError, build_dataloader
from harness.data.sources import source_units
from harness.data.token_cache import META_FILE, STARTS_FILE, TOKENS_FILE, publish, tokenizer_identity
from harness.data.tokenizer import ByteTokenizer, HFTokenizer
from tests.unit.test_data import (
    NoSpecialsTokenizer,
    expected_stream,
    make_word_level_tokenizer,
    random_documents,
    write_jsonl,
)


class CountingTokenizer(ByteTokenizer):
    def __init__(self):
        self.encode_calls = 0

    def encode(self, text: str) -> list[int]:
        self.encode_calls += 1
        return super().encode(text)


def build(source: Path, cache_dir: Path, tok=None, kind: str = "jsonl"):
    return build_dataloader(kind, str(source), "text", tok or ByteTokenizer(), 8, 1, cache_dir=cache_dir)


def cache_folders(cache_dir: Path) -> list[Path]:
    return sorted(p for p in cache_dir.iterdir() if not p.name.startswith("."))


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_cache_holds_uint32_tokens_int64_document_starts_and_a_readable_meta(tmp_path):
    docs = random_documents(20)
    docs[3] = ""
    source = write_jsonl(tmp_path / "d.jsonl", docs)
    tok = NoSpecialsTokenizer()  # the empty document then leaves no trace
    folder = build(source, tmp_path / "cache", tok).cache.folder
    tokens, starts = expected_stream(docs, tok)
    assert folder.parent == tmp_path / "cache"
    assert np.fromfile(folder / TOKENS_FILE, dtype=np.uint32).tolist() == tokens
    assert np.fromfile(folder / STARTS_FILE, dtype=np.int64).tolist() == [i for i, s in enumerate(starts) if s]
    meta = json.loads((folder / META_FILE).read_text())
    assert (meta["format"], meta["num_tokens"], meta["num_documents"]) == (2, len(tokens), 19)
    assert (meta["token_min"], meta["token_max"]) == (min(tokens), max(tokens))
    assert meta["source"]["files"][0]["path"] == str(source.resolve())
    assert meta["tokenizer"]["class"].endswith("NoSpecialsTokenizer")
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [folder.name]  # no temporary folder left


def test_second_build_reuses_the_cache_without_tokenizing(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", random_documents(30))
    first, second = CountingTokenizer(), CountingTokenizer()
    a = build(source, tmp_path / "cache", first)
    b = build(source, tmp_path / "cache", second)
    assert first.encode_calls == 30 and second.encode_calls == 0
    assert a.cache.folder == b.cache.folder and len(cache_folders(tmp_path / "cache")) == 1


def test_a_changed_source_file_or_tokenizer_gets_a_new_cache(tmp_path):
    source = write_jsonl(tmp_path / "d.jsonl", ["abc", "def"])
    cache_dir = tmp_path / "cache"
    folders = [build(source, cache_dir).cache.folder]
    stat = source.stat()
    source.write_text(source.read_text().replace("abc", "xyz"))  # same size, other content ...
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # ... and (as any write does) another mtime
    folders.append(build(source, cache_dir).cache.folder)
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))  # touched only
    folders.append(build(source, cache_dir).cache.folder)
    with open(source, "a") as f:
        f.write(json.dumps({"text": "ghi"}) + "\n")
    folders.append(build(source, cache_dir).cache.folder)
    folders.append(build(source, cache_dir, NoSpecialsTokenizer()).cache.folder)
    assert len(set(folders)) == 5 and cache_folders(cache_dir) == sorted(folders)
    assert build(source, cache_dir).cache.tokens[1:4].tolist() == list(b"xyz")  # after bos


def test_hf_tokenizer_identity_is_the_hash_of_its_tokenizer_json(tmp_path):
    for name in "abc":
        make_word_level_tokenizer(tmp_path / name, {"bos_token": "<s>"})
    other_vocab = tmp_path / "c" / "tokenizer.json"
    other_vocab.write_text(other_vocab.read_text().replace('"world"', '"earth"'))
    a, b, c = (tokenizer_identity(HFTokenizer(str(tmp_path / name))) for name in "abc")
    assert a == b  # the same tokenizer in another folder: same identity, so the same cache
    assert a.keys() == c.keys() and a != c  # same class, specials and size; another vocabulary


def test_cache_is_the_same_whatever_the_unit_size(tmp_path, monkeypatch):
    source = tmp_path / "d.txt"
    source.write_text("\n\n".join(random_documents(40, seed=8)) + "\n")
    whole = build(source, tmp_path / "whole", kind="text").cache.folder
    monkeypatch.setattr(harness.data.cached, "UNIT_BYTES", 37)
    assert len(source_units("text", [source], 37)) > 20
    split = build(source, tmp_path / "split", kind="text").cache.folder
    assert folder_bytes(split) == folder_bytes(whole)


def test_parquet_row_groups_are_the_work_units(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    docs = random_documents(25, seed=9)
    source = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": docs}), source, row_group_size=4)
    assert len(source_units("parquet", [source], harness.data.cached.UNIT_BYTES)) == 7
    seen, real_read_unit = [], harness.data.cached.read_unit

    def recording_read_unit(kind, unit, text_field="text"):
        seen.append(unit)
        return real_read_unit(kind, unit, text_field)

    monkeypatch.setattr(harness.data.cached, "read_unit", recording_read_unit)
    folder = build(source, tmp_path / "cache", kind="parquet").cache.folder
    assert [(u.start, u.stop) for u in seen] == [(i, i + 1) for i in range(7)]
    assert np.fromfile(folder / TOKENS_FILE, dtype=np.uint32).tolist() == expected_stream(docs, ByteTokenizer())[0]


def test_an_interrupted_build_left_behind_is_never_used(tmp_path):
    docs = random_documents(30, seed=10)
    source, cache_dir = write_jsonl(tmp_path / "d.jsonl", docs), tmp_path / "cache"
    folder = build(source, cache_dir).cache.folder
    # What a build killed before its rename leaves: a temporary folder, here with a wrong stream and no meta.json.
    leftover = cache_dir / f".{folder.name}.tmp-killed"
    shutil.move(folder, leftover)
    (leftover / META_FILE).unlink()
    np.zeros(10, dtype=np.uint32).tofile(leftover / TOKENS_FILE)
    rebuilt = build(source, cache_dir).cache
    assert rebuilt.folder == folder and rebuilt.tokens.tolist() == expected_stream(docs, ByteTokenizer())[0]
    assert leftover.is_dir()  # not ours to delete: another job may still be building there


def test_a_cache_folder_without_meta_json_is_an_error_naming_it(tmp_path):
    source, cache_dir = write_jsonl(tmp_path / "d.jsonl", random_documents(30)), tmp_path / "cache"
    folder = build(source, cache_dir).cache.folder
    (folder / META_FILE).unlink()
    with pytest.raises(DataError, match=f"{folder.name} is damaged: it has no meta.json.*Delete the folder"):
        build(source, cache_dir)


def test_a_truncated_token_file_is_an_error_naming_the_folder(tmp_path):
    source, cache_dir = write_jsonl(tmp_path / "d.jsonl", random_documents(30)), tmp_path / "cache"
    folder = build(source, cache_dir).cache.folder
    with open(folder / TOKENS_FILE, "r+b") as f:
        f.truncate(f.seek(0, os.SEEK_END) - 4)
    with pytest.raises(DataError, match=f"{folder.name} is damaged: tokens.bin has .*Delete the folder"):
        build(source, cache_dir)


def test_publishing_onto_a_cache_another_job_published_keeps_that_one(tmp_path):
    source, cache_dir = write_jsonl(tmp_path / "d.jsonl", random_documents(30)), tmp_path / "cache"
    folder = build(source, cache_dir).cache.folder
    before = folder_bytes(folder)
    late = cache_dir / f".{folder.name}.tmp-late"  # the same build, finished second
    shutil.copytree(folder, late)
    (late / TOKENS_FILE).write_bytes(b"\0" * len(before[TOKENS_FILE]))  # marks it: must not replace the first
    publish(late, folder)
    assert folder_bytes(folder) == before and not late.exists()


def test_a_bad_line_fails_the_build_and_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setattr(harness.data.cached, "UNIT_BYTES", 64)
    source = tmp_path / "bad.jsonl"
    source.write_text("\n".join([json.dumps({"text": f"document {i}"}) for i in range(12)] + ["{oops"]) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:13: not a JSON object"):
        build(source, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []
