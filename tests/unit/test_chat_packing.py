"""Chat rows packed whole (harness/data/chat_packing.py, loader.py's ChatCacheLoader / ChatStreamPacker): every
conversation inside one row, padded, labels only on targets, the same global rows at any data-parallel degree, exact
resume; the launch checks of chat configs; debug_sft.toml trains. The rendering and the mask: test_chat_data.py."""

from __future__ import annotations

import json
import logging
import pickle
import random
import re
from pathlib import Path

import pytest

from harness.config import ConfigError, check_launch
from harness.data.chat import ChatOptions
from harness.data.chat_packing import pack_conversations
from harness.data.encoders import ChatEncoder
from harness.data.errors import DataError
from harness.data.loader import IGNORE_INDEX, build_dataloader
from harness.data.prefetch import PrefetchingLoader
from harness.data.sources import Row
from harness.data.streamed import ChatStreamPacker
from harness.data.tokenizer import HFTokenizer
from tests.runs import write_rows
from tests.unit.test_data import batch_rows, fake_datasets, take

REPO = Path(__file__).resolve().parents[2]
DEBUG_CHAT = REPO / "data" / "debug_chat"
SFT_CONFIG = str(REPO / "train_configs" / "debug_sft.toml")
TOKENIZER = HFTokenizer(str(DEBUG_CHAT / "tokenizer"))  # byte-level: a conversation is about as long as its text
PAD = TOKENIZER.eos_id


def conversations(n: int, seed: int = 0) -> list[dict]:
    """Conversations of 30 to ~150 tokens: some of them longer than the short rows below."""
    r = random.Random(seed)
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": f"q{i} " + "x" * r.randint(0, 40)},
                    {"role": "assistant", "content": f"a{i} " + "y" * r.randint(0, 40)}]
        if r.random() < 0.3:
            messages += [{"role": "user", "content": "again"}, {"role": "assistant", "content": "z" * r.randint(1, 30)}]
        rows.append({"messages": messages})
    return rows


def encoded(rows: list[dict], targets: str = "assistant") -> list[tuple[list[int], list[int]]]:
    encoder = ChatEncoder(TOKENIZER, ChatOptions(targets=targets))
    return [encoder(Row(row, lambda: "?")) for row in rows]


def expected_rows(convs: list[tuple[list[int], list[int]]], L: int, overlong: str = "drop") -> list[dict]:
    """The global rows, written out from the contract (docs/design.md, "Chat data"), not from the loader."""
    R, rows, current = L + 1, [], []
    for ids, flags in convs:
        if len(ids) > R:
            if overlong == "drop":
                continue
            ids, flags = ids[:R], flags[:R]
        if sum(len(c[0]) for c in current) + len(ids) > R:
            rows.append(current)
            current = []
        current.append((ids, flags))
    rows.append(current)
    out = []
    for row in rows:
        tokens, flags, doc = [], [], []
        for d, (ids, fl) in enumerate(row):
            tokens += ids
            flags += fl
            doc += [d] * len(ids)
        pad = R - len(tokens)
        tokens, flags, doc = tokens + [PAD] * pad, flags + [0] * pad, doc + [-1] * pad  # padding: its own document
        labels = [tokens[i + 1] if flags[i + 1] and doc[i + 1] == doc[i] else IGNORE_INDEX for i in range(L)]
        positions = [0 if i == 0 or doc[i] != doc[i - 1] else None for i in range(L)]
        for i in range(L):
            positions[i] = 0 if positions[i] == 0 else positions[i - 1] + 1
        out.append({"input_ids": tokens[:L], "labels": labels, "position_ids": positions})
    return out


def chat_loader(source: Path, tmp_path: Path, L: int, b: int, rank: int = 0, world: int = 1, infinite: bool = True,
                **options):
    return build_dataloader("jsonl", str(source), "text", TOKENIZER, L, b, dp_rank=rank, dp_world_size=world,
                            cache_dir=tmp_path / "cache", infinite=infinite, data_format="chat",
                            chat=ChatOptions(**options))


@pytest.fixture
def corpus(tmp_path) -> tuple[Path, list[dict]]:
    rows = conversations(60)
    return write_rows(tmp_path / "chats.jsonl", rows), rows


# -- the layout ----------------------------------------------------------------------------------------------------


def test_greedy_packing_keeps_order_and_counts_what_it_drops_or_cuts():
    layout = pack_conversations([3, 4, 2, 9, 5, 5, 1], row_tokens=8, overlong="drop")
    rows = [list(zip(layout.docs[a:b].tolist(), layout.taken[a:b].tolist()))
            for a, b in zip(layout.row_first[:-1], layout.row_first[1:])]
    assert rows == [[(0, 3), (1, 4)], [(2, 2), (4, 5)], [(5, 5), (6, 1)]] and (layout.dropped, layout.truncated) == (1, 0)
    layout = pack_conversations([3, 4, 2, 9, 5, 5, 1], row_tokens=8, overlong="truncate")
    assert layout.taken.tolist() == [3, 4, 2, 8, 5, 5, 1] and (layout.dropped, layout.truncated) == (0, 1)
    assert layout.row_first.tolist() == [0, 2, 3, 4, 5, 7]


@pytest.mark.parametrize("overlong", ["drop", "truncate"])
def test_cached_rows_hold_whole_conversations_padded_with_labels_on_targets_only(corpus, tmp_path, overlong, caplog):
    source, rows = corpus
    L = 96
    convs = encoded(rows)
    longer = sum(len(ids) > L + 1 for ids, _ in convs)
    assert 0 < longer < len(convs)  # some conversations do not fit a row
    with caplog.at_level(logging.INFO):
        loader = chat_loader(source, tmp_path, L, 2, infinite=False, overlong=overlong)
    got = [row for batch in loader for row in batch_rows(batch)]
    want = expected_rows(convs, L, overlong)
    assert len(got) == len(want) // 2 * 2 and got == want[: len(got)]
    kept = len(convs) - longer if overlong == "drop" else len(convs)
    cut = (longer, 0) if overlong == "drop" else (0, longer)
    summary = [r.getMessage() for r in caplog.records if "chat rows of" in r.getMessage()]
    assert len(summary) == 1 and (f"{kept} conversations kept, {cut[0]} dropped and {cut[1]} truncated (longer than "
                                  f"seq_len + 1 = {L + 1} tokens; chat_overlong = '{overlong}'); {len(want)} rows of "
                                  f"{L + 1} tokens: ") in summary[0]
    assert all(any(label != IGNORE_INDEX for label in r["labels"]) for r in want)


def test_a_conversation_is_never_split_and_padding_is_its_own_document(corpus, tmp_path):
    source, _ = corpus
    L, im_start, newline = 128, TOKENIZER.encode("<|im_start|>")[0], TOKENIZER.encode("\n")[0]
    for row in batch_rows(next(chat_loader(source, tmp_path, L, 8))):
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [L]
        for a, b in zip(starts, starts[1:]):
            ids, labels = row["input_ids"][a:b], row["labels"][a:b]
            if set(ids) == {PAD} and b == L:  # the padding: the row's last document, never a label
                assert labels == [IGNORE_INDEX] * (b - a)
                continue
            assert ids[0] == im_start  # a conversation from its first token ...
            if b < L:
                assert ids[-1] == newline and labels[-1] == IGNORE_INDEX  # ... to its last ("<|im_end|>\n")


def test_chat_targets_all_labels_every_next_token_of_a_conversation(corpus, tmp_path):
    source, rows = corpus
    got = batch_rows(next(chat_loader(source, tmp_path, 128, 4, targets="all")))
    assert got == expected_rows(encoded(rows, "all"), 128)[:4]
    row = got[0]
    inside = [i for i in range(127) if row["position_ids"][i + 1] != 0]  # the next token is of the same document
    assert all(row["labels"][i] == row["input_ids"][i + 1] for i in inside if row["input_ids"][i + 1] != PAD)


def test_an_all_overlong_set_is_an_error_saying_what_to_do(corpus, tmp_path):
    source, _ = corpus
    with pytest.raises(DataError, match=r"all 60 conversations .* are longer than seq_len \+ 1 = 17 tokens.*raise "
                                        r"training\.seq_len, or set training\.chat_overlong = 'truncate'"):
        chat_loader(source, tmp_path, 16, 1)
    with pytest.raises(DataError, match=r"none of the 60 rows .* holds a target token"):  # each prompt fills its row
        chat_loader(source, tmp_path, 16, 1, overlong="truncate")
    assert next(chat_loader(source, tmp_path, 40, 1, overlong="truncate"))["input_ids"].shape == (1, 40)


# -- dealing and resume ----------------------------------------------------------------------------------------------


def test_chat_rows_do_not_depend_on_the_data_parallel_degree(corpus, tmp_path):
    source, rows = corpus
    L, global_batch = 96, 4
    want = expected_rows(encoded(rows), L)
    for world in (1, 2):
        b = global_batch // world
        loaders = [chat_loader(source, tmp_path, L, b, rank=r, world=world) for r in range(world)]
        for m in range(3):
            for r, loader in enumerate(loaders):
                assert batch_rows(next(loader)) == [want[m * global_batch + r + j * world] for j in range(b)]


@pytest.mark.parametrize("k", [1, 9])  # 9 batches of 4 run past the end of the rows (epoch 2)
def test_chat_resume_mid_epoch_yields_the_same_batches_at_any_degree(corpus, tmp_path, k):
    source, _ = corpus
    L = 96
    uninterrupted = chat_loader(source, tmp_path, L, 4)
    take(uninterrupted, k)
    state = pickle.loads(pickle.dumps(uninterrupted.state_dict()))
    json.dumps(state)
    expected = [row for batch in take(uninterrupted, 3) for row in batch_rows(batch)]
    resumed = chat_loader(source, tmp_path, L, 4)
    resumed.load_state_dict(state)
    assert [row for batch in take(resumed, 3) for row in batch_rows(batch)] == expected
    two = [chat_loader(source, tmp_path, L, 2, rank=r, world=2) for r in range(2)]
    for loader in two:
        loader.load_state_dict(state)
    first = [batch_rows(next(loader)) for loader in two]
    assert [first[0][0], first[1][0], first[0][1], first[1][1]] == expected[:4]


def test_a_saved_position_of_other_packing_is_refused(corpus, tmp_path):
    source, rows = corpus
    state = chat_loader(source, tmp_path, 96, 2).state_dict()
    with pytest.raises(DataError, match="packed as 'chat, chat_overlong drop', this run packs them as 'chat, "
                                        "chat_overlong truncate'"):
        chat_loader(source, tmp_path, 96, 2, overlong="truncate").load_state_dict(state)
    text_source = write_rows(tmp_path / "text.jsonl", [{"text": json.dumps(r)} for r in rows])
    text = build_dataloader("jsonl", str(text_source), "text", TOKENIZER, 96, 2, cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match="packed as 'chat, chat_overlong drop', this run packs them as 'text'"):
        text.load_state_dict(state)


# -- Hugging Face streams ----------------------------------------------------------------------------------------------


def test_a_chat_stream_packs_its_rank_shard_and_resumes_exactly(monkeypatch):
    rows = conversations(40, seed=1)
    fake_datasets(monkeypatch, rows)
    L = 96
    stream = lambda rank=0, world=1, infinite=True: build_dataloader(
        "hf", "fake/chats", "text", TOKENIZER, L, 2, dp_rank=rank, dp_world_size=world, infinite=infinite,
        data_format="chat", chat=ChatOptions())
    got = [row for batch in stream(infinite=False) for row in batch_rows(batch)]
    want = expected_rows(encoded(rows), L)
    assert got == want[: len(got)] and len(got) >= len(want) - 2
    assert batch_rows(next(stream(1, 2))) == expected_rows(encoded(rows[1::2]), L)[:2]  # rank 1's shard

    reference = stream()
    expected = [batch_rows(b) for b in take(reference, 8)]
    loader = stream()
    take(loader, 3)
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    loader.close()
    resumed = stream()
    resumed.load_state_dict(state)
    assert [batch_rows(b) for b in take(resumed, 5)] == expected[3:]
    for each in (reference, resumed):
        each.close()


def test_a_chat_stream_state_does_not_resume_a_text_stream_nor_the_reverse(monkeypatch):
    fake_datasets(monkeypatch, conversations(10))
    chat_stream = PrefetchingLoader(ChatStreamPacker(lambda: iter([]), ChatEncoder(TOKENIZER, ChatOptions()), 32, 1))
    text = build_dataloader("hf", "fake/chats", "text", TOKENIZER, 32, 1)
    with pytest.raises(DataError, match="streamed chat dataset and cannot resume the streamed text dataset"):
        text.load_state_dict(chat_stream.state_dict())
    with pytest.raises(DataError, match="not that of a streamed chat dataset"):
        chat_stream.load_state_dict(text.state_dict())


# -- the launch and a run ----------------------------------------------------------------------------------------------


def test_chat_configs_that_cannot_run_are_named_before_the_run(tmp_path):
    no_template = tmp_path / "tok"
    no_template.mkdir()
    (no_template / "tokenizer.json").write_text((DEBUG_CHAT / "tokenizer" / "tokenizer.json").read_text())
    cases = [
        (["--training.dataset_source", "text"], "training.dataset_source = 'text' cannot hold chat data"),
        (["--model.tokenizer_path", ""], "the built-in byte tokenizer has none: set model.tokenizer_path"),
        (["--model.tokenizer_path", str(no_template)], f"the tokenizer folder {no_template} has no chat template"),
        (["--validation.dataset_source", "text"], "validation.dataset_source = 'text' cannot hold chat data"),
    ]
    for argv, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_launch(["--config", SFT_CONFIG, *argv], 1)
    check_launch(["--config", SFT_CONFIG], 1)


def test_debug_sft_trains_its_loss_falls_and_the_export_renders_chats_as_the_run_did(tmp_path, own_logging):
    from transformers import AutoTokenizer

    from harness.train import main

    out = tmp_path / "out"
    assert main(["--config", SFT_CONFIG, "--job.dump_folder", str(out), "--training.steps", "30",
                 "--training.seq_len", "128", "--training.local_batch_size", "4", "--metrics.log_freq", "1",
                 "--metrics.enable_tensorboard", "false", "--validation.freq", "30", "--validation.steps", "2"]) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 30 and losses[-1] < 0.7 * losses[0]  # measured 0.55
    assert any("val_loss" in m for m in metrics)
    exported = AutoTokenizer.from_pretrained(out / "hf")
    row = json.loads((DEBUG_CHAT / "val.jsonl").read_text().splitlines()[0])
    assert (exported.apply_chat_template(row["messages"], tokenize=True)["input_ids"]
            == ChatEncoder(TOKENIZER, ChatOptions())(Row(row, lambda: "?"))[0])


def test_a_chat_file_without_a_usable_conversation_exits_2_with_one_error_line(tmp_path, capsys, own_logging):
    from harness.train import main

    bad = write_rows(tmp_path / "bad.jsonl", [{"messages": [{"role": "user", "content": "no reply"}]}] * 3)
    assert main(["--config", SFT_CONFIG, "--job.dump_folder", str(tmp_path / "out"), "--training.dataset_path",
                 str(bad), "--validation.enable", "false"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{bad}:1: no assistant turn" in errors[0], errors


def test_the_shipped_chat_corpus_is_small_and_every_conversation_in_it_is_kept(tmp_path):
    files = [p for p in DEBUG_CHAT.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 2 * 1024 * 1024 and (DEBUG_CHAT / "README.md").is_file()
    loader = chat_loader(DEBUG_CHAT / "val.jsonl", tmp_path, 512, 4)
    assert loader.cache.meta["skipped_rows"]["count"] == 0 and len(loader.layout.docs) == 200


# -- rows without a target ---------------------------------------------------------------------------------------------


def long_prompt(i: int, prompt: int = 200) -> dict:
    """A conversation whose prompt alone is longer than a row of 65 tokens: truncated, it keeps no assistant turn."""
    return {"messages": [{"role": "user", "content": f"q{i} " + "x" * prompt},
                         {"role": "assistant", "content": f"a{i}"}]}


def test_truncation_that_cuts_off_every_assistant_turn_is_an_error_naming_the_setting(tmp_path):
    source = write_rows(tmp_path / "chats.jsonl", [long_prompt(i) for i in range(6)])
    with pytest.raises(DataError, match=rf"none of the 6 rows of the chat dataset {source} .*holds a target token: "
                                        r"training.chat_overlong = 'truncate' cut all 6 conversations to their first "
                                        r"seq_len \+ 1 = 65 tokens, before their first target; raise "
                                        r"training.seq_len, or set training.chat_overlong = 'drop'"):
        chat_loader(source, tmp_path, 64, 1, overlong="truncate")


def test_rows_without_a_target_are_counted_at_the_start(tmp_path, caplog):
    rows = [long_prompt(0), *conversations(4), long_prompt(1)]
    source = write_rows(tmp_path / "chats.jsonl", rows)
    with caplog.at_level(logging.INFO):
        loader = chat_loader(source, tmp_path, 64, 1, overlong="truncate", infinite=False)
    summary = [r.getMessage() for r in caplog.records if "chat rows of" in r.getMessage()]
    empty = sum(all(label == IGNORE_INDEX for label in row["labels"]) for batch in loader for row in batch_rows(batch))
    assert empty == 2 and len(summary) == 1
    assert f"{empty} rows ({empty / loader.num_rows:.1%}) hold no target token (truncated before it)" in summary[0]


def test_a_chat_stream_whose_rows_hold_no_target_is_an_error(monkeypatch):
    fake_datasets(monkeypatch, [long_prompt(i) for i in range(3)])
    loader = build_dataloader("hf", "fake/chats", "text", TOKENIZER, 64, 1, infinite=False, data_format="chat",
                              chat=ChatOptions(overlong="truncate"))
    with pytest.raises(DataError, match=r"dp rank 0 of 1 has nothing to train on: all 3 rows of its shard of the "
                                        r"dataset were left out or hold no target \(the first: .* row 0: truncated to "
                                        r"seq_len \+ 1 = 65 tokens, before its first target"):
        list(loader)


def test_a_validation_set_too_small_for_one_micro_batch_is_an_error(tmp_path):
    from harness.config import load_config
    from harness.validation import Validator

    source = write_rows(tmp_path / "val.jsonl", conversations(1))
    cfg = load_config(["--config", SFT_CONFIG, "--validation.enable", "true", "--validation.dataset_path",
                       str(source), "--training.seq_len", "128", "--training.local_batch_size", "4",
                       "--training.dataset_cache_dir", str(tmp_path / "cache")])
    with pytest.raises(DataError, match=rf"the validation set {source} has 1 rows of seq_len \+ 1 = 129 tokens, fewer "
                                        r"than one micro-batch of all data-parallel ranks \(4 = 1 ranks x "
                                        r"local_batch_size 4\): it gives no validation loss"):
        Validator(cfg, TOKENIZER, 0, 1, None, None)


def test_a_validation_that_reads_no_target_is_an_error(monkeypatch, tmp_path):
    import torch

    from harness.config import load_config
    from harness.validation import Validator

    fake_datasets(monkeypatch, conversations(1))  # a streamed set too short for one row
    cfg = load_config(["--config", SFT_CONFIG, "--validation.enable", "true", "--validation.dataset_source", "hf",
                       "--validation.dataset_path", "fake/chats", "--validation.steps", "-1",
                       "--training.dataset_cache_dir", str(tmp_path / "cache")])
    validator = Validator(cfg, TOKENIZER, 0, 1, torch.device("cpu"), None)
    with pytest.raises(DataError, match=r"validation read no target token from fake/chats \(validation.steps = -1\)"):
        validator.validate(torch.nn.Linear(1, 1))


def test_train_with_truncation_that_leaves_no_target_exits_2_naming_the_setting(tmp_path, capsys, own_logging):
    from harness.train import main

    source = write_rows(tmp_path / "chats.jsonl", [long_prompt(i, prompt=600) for i in range(8)])
    assert main(["--config", SFT_CONFIG, "--job.dump_folder", str(tmp_path / "out"), "--training.dataset_path",
                 str(source), "--validation.enable", "false", "--training.chat_overlong", "truncate",
                 "--training.steps", "1"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "training.chat_overlong = 'truncate' cut all 8 conversations" in errors[0], errors
