"""harness.train as a user meets it: Ctrl-C while it starts, and a relaunch of a run that is already done."""

from __future__ import annotations

import builtins
from pathlib import Path

from harness.train import INTERRUPTED, main

REPO = Path(__file__).resolve().parents[2]
FAST = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false",
        "--checkpoint.export_hf_at_end", "false"]


def test_ctrl_c_while_the_trainer_loads_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    real_import = builtins.__import__

    def interrupted_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 1 and name == "trainer":  # the heavy import, which takes seconds on a cold machine
            raise KeyboardInterrupt
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", interrupted_import)
    assert main([*FAST, "--job.dump_folder", str(tmp_path)]) == INTERRUPTED
    err = capsys.readouterr().err
    assert err.strip() == "interrupted while starting; nothing saved"


def test_a_relaunch_of_a_finished_run_says_there_is_nothing_to_train(tmp_path, capsys):
    run = [*FAST, "--training.steps", "2", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
           "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path)]
    assert main(run) == 0
    assert "done: 2 steps, 256 tokens in" in capsys.readouterr().out
    assert main(run) == 0
    out = capsys.readouterr().out
    assert "done: nothing to train: step 2 of training.steps 2 already done" in out and "nan" not in out
    assert main([*run[:-4], "--training.steps", "3", "--job.dump_folder", str(tmp_path)]) == 0
    assert "done: 1 step (resumed at step 2, now 3), 128 tokens in" in capsys.readouterr().out


def test_a_launch_that_returns_early_leaves_the_callers_sigterm_handler_as_it_was(tmp_path):
    import signal

    from harness.train import main

    mine = lambda signum, frame: None  # noqa: E731
    previous = signal.signal(signal.SIGTERM, mine)
    try:
        assert main(["--training.stesp", "1", "--job.dump_folder", str(tmp_path / "o")]) == 2  # a bad key: exit 2
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)
