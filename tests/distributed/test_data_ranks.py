"""The token cache built by 2 CPU ranks (gloo): shared work, the same bytes as one process, errors on every rank (bad
data and a damaged cache alike: a DataError, exit 2, on both)."""

import json
from pathlib import Path

import harness.data.cached
from harness.data.loader import build_dataloader
from harness.data.sources import source_units
from harness.data.tokenizer import ByteTokenizer
from tests.distributed.launch import Run, register
from tests.unit.test_data import expected_rows, random_documents, write_jsonl

WORKER = "tests.distributed.data_ranks_worker:build"
UNIT_BYTES = 200  # about 7 lines of the test file: 20-odd units
DOCS = random_documents(150, seed=11)


def bad_lines() -> tuple[list[str], int]:
    """JSON lines of 100 documents, the one that opens unit 3 (rank 1's) cut short; and its index."""
    lines = [json.dumps({"text": doc}) for doc in random_documents(100, seed=12)]
    starts = [sum(len(line) + 1 for line in lines[:i]) for i in range(len(lines))]
    bad = next(i for i, start in enumerate(starts) if start >= 3 * UNIT_BYTES)
    lines[bad] = '{"text": "cut short'
    return lines, bad


def write_bad_dataset(folder: Path) -> None:
    (folder / "bad.jsonl").write_text("\n".join(bad_lines()[0]) + "\n")


GOOD = register(Run("data_ranks/good", 2, WORKER, ("d.jsonl", str(UNIT_BYTES)),
                    lambda folder: write_jsonl(folder / "d.jsonl", DOCS)))
BAD = register(Run("data_ranks/bad", 2, WORKER, ("bad.jsonl", str(UNIT_BYTES)), write_bad_dataset))
DAMAGED = register(Run("data_ranks/damaged", 2, "tests.distributed.data_ranks_worker:reopen_damaged", ("d.jsonl",),
                       lambda folder: write_jsonl(folder / "d.jsonl", DOCS)))


def test_two_ranks_build_the_cache_of_one_process_each_tokenizing_only_its_units(launches, tmp_path, monkeypatch):
    folder = launches.folder_of(GOOD)
    dataset = folder / "d.jsonl"
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]

    units = [[u.start, u.stop] for u in source_units("jsonl", [dataset], UNIT_BYTES)]
    assert len(units) > 10
    assert ranks[0]["units"] == units[0::2] and ranks[1]["units"] == units[1::2]  # each parsed its own units only

    monkeypatch.setattr(harness.data.cached, "UNIT_BYTES", UNIT_BYTES)
    single = build_dataloader("jsonl", str(dataset), "text", ByteTokenizer(), 16, 4, cache_dir=tmp_path / "one")
    two_folder = Path(ranks[0]["cache"])
    assert ranks[1]["cache"] == str(two_folder) and two_folder.name == single.cache.folder.name
    files = sorted(p.name for p in single.cache.folder.iterdir())
    assert sorted(p.name for p in two_folder.iterdir()) == files
    for name in files:
        assert (two_folder / name).read_bytes() == (single.cache.folder / name).read_bytes(), name

    want = [row["input_ids"] for row in expected_rows(DOCS, ByteTokenizer(), 16)]
    assert ranks[0]["rows"] == [want[0], want[2]] and ranks[1]["rows"] == [want[1], want[3]]  # global rows dealt


def test_a_bad_line_in_a_unit_of_rank_one_fails_both_ranks_with_a_data_error_naming_file_and_line(launches):
    folder = launches.folder_of(BAD)
    assert not any(folder.glob("rank*.json"))  # neither rank built a loader
    where = f"bad.jsonl:{bad_lines()[1] + 1}: not a JSON object"
    rank0, rank1 = ((folder / f"rank{r}.error").read_text() for r in range(2))
    assert rank1.startswith("DataError: ") and where in rank1
    # Rank 0 read its own units fine; it fails with rank 1's DataError, so it too exits 2 with one line.
    assert rank0.startswith("DataError: tokenizing the dataset failed on rank 1: DataError: ") and where in rank0
    assert [p.name for p in (folder / "cache").iterdir()] == []  # no cache, no temporary folder


def test_a_damage_only_rank_zeros_full_check_sees_fails_both_ranks_with_a_data_error(launches):
    folder = launches.folder_of(DAMAGED)
    rank0, rank1 = ((folder / f"rank{r}.error").read_text() for r in range(2))
    damage = "is damaged: tokens.bin does not match its sha256 in meta.json"
    assert rank0.startswith("DataError: dataset cache ") and damage in rank0
    assert rank1.startswith("DataError: opening dataset cache ") and "failed on rank 0: DataError: " in rank1
    assert damage in rank1
