"""scripts/make_debug_corpus.py and scripts/make_debug_chat.py on bad input: one `error:` line and exit 2, nothing
written. (What they write: tests/unit/test_data.py and test_chat_data.py read the shipped data they made.)"""

from __future__ import annotations

import pytest

from scripts import make_debug_chat, make_debug_corpus


@pytest.mark.parametrize("script, flags, named", [
    (make_debug_corpus, ["--target-bytes", "0"], "error: --target-bytes must be positive, got 0"),
    (make_debug_chat, ["--train", "-3", "--val", "-1"], "error: --train must be 0 or more, got -3; --val must be 0 "
                                                        "or more, got -1"),
])
def test_values_out_of_range_are_named_in_one_line(script, flags, named, tmp_path, capsys):
    assert script.main(["--out", str(tmp_path / "out"), *flags]) == 2
    assert capsys.readouterr().err.splitlines() == [named]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", [make_debug_corpus, make_debug_chat])
def test_an_output_folder_that_cannot_be_made_and_a_bad_flag_are_one_line(script, tmp_path, capsys):
    (tmp_path / "file").touch()
    assert script.main(["--out", str(tmp_path / "file" / "out"), "--seed", "1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "Not a directory" in err[0]
    with pytest.raises(SystemExit) as e:
        script.main(["--seed", "abc"])
    assert e.value.code == 2 and capsys.readouterr().err.splitlines() == [
        "error: argument --seed: invalid int value: 'abc' (--help lists the arguments)"]
