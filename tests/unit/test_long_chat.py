"""scripts/make_long_chat.py: conversations whose length, as the release's chat template renders and its tokenizer
counts them (transformers' apply_chat_template, not the script's own count), is the asked-for 1-4k-token kind."""

from __future__ import annotations

import json

import pytest

from scripts.make_long_chat import TASKS, main
from scripts.release_tokenizer import write_tokenizer
from tests.unit.test_release_checkpoint import CHAT_TEMPLATE


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("release-tokenizer")
    write_tokenizer(folder, CHAT_TEMPLATE.read_text(encoding="utf-8"))
    return folder


def test_rendered_conversations_are_as_long_as_asked_and_answer_their_tasks(tokenizer_folder, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "chat"
    assert main(["--tokenizer", str(tokenizer_folder), "--out", str(out), "--train", "40", "--val", "2",
                 "--min-tokens", "400", "--max-tokens", "1200", "--seed", "7"]) == 0
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(tokenizer_folder)
    lengths = [len(tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"])
               for row in rows]
    # The script counts each turn's content plus 5 template tokens; the official template adds a few more to the
    # last assistant turn (an empty <think> block): 16 tokens of slack above the asked maximum.
    assert len(rows) == 40 and 400 <= min(lengths) and max(lengths) <= 1200 + 16
    assert max(lengths) - min(lengths) > 400  # drawn over the range, not all one length
    for row in rows:
        turns = [m for m in row["messages"] if m["role"] != "system"]
        assert 4 <= len(turns) <= 12 and [m["role"] for m in turns] == ["user", "assistant"] * (len(turns) // 2)
        for user, reply in zip(turns[::2], turns[1::2]):
            task, words = user["content"].split(": ", 1)
            assert reply["content"] == TASKS[task](words.split())
    again = tmp_path / "again"
    main(["--tokenizer", str(tokenizer_folder), "--out", str(again), "--train", "40", "--val", "2",
          "--min-tokens", "400", "--max-tokens", "1200", "--seed", "7"])
    assert (again / "train.jsonl").read_bytes() == (out / "train.jsonl").read_bytes()


def test_bad_arguments_are_one_error_line(tmp_path, capsys):
    assert main(["--tokenizer", str(tmp_path), "--out", str(tmp_path / "o"), "--train", "-1",
                 "--min-tokens", "10", "--max-tokens", "5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--train" in err[0] and "--min-tokens" in err[0] and "tokenizer.json" in err[0]
    assert not (tmp_path / "o").exists()
