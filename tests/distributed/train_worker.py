"""Worker for test_resume and test_multinode (a run of the shared launches, tests/distributed/launch.py): the
training entry point each rank runs under run_train.sh (`harness.train.main`), on the config flags given, dumping to
<folder>/run (a relaunch finds the checkpoints of an earlier run there). Each rank writes what it printed to
<folder>/stdout.rank<r>.txt and <folder>/stderr.rank<r>.txt (its log lines: rank 0's at INFO level, as run_train.sh
shows them) and its exit code to <folder>/exit_code.rank<r>. The process group, signal handlers and logging are left
as they were for the launch's next runs."""

import contextlib
import logging
import os
import signal
from pathlib import Path
from unittest import mock

import torch.distributed as dist

from harness.config import DEFAULT_CONFIG
from harness.train import main
from tests import runs


def train(folder: str, *flags: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    signals = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    argv = ["--config", str(DEFAULT_CONFIG), *flags, "--job.dump_folder", os.path.join(folder, "run")]
    try:
        with (open(Path(folder, f"stdout.rank{rank}.txt"), "w") as out,
              open(Path(folder, f"stderr.rank{rank}.txt"), "w") as err,
              contextlib.redirect_stdout(out), contextlib.redirect_stderr(err),
              mock.patch.object(dist, "destroy_process_group", lambda *args, **kwargs: None)):
            code = main(argv)  # run_train.sh adds the default config, as here
    finally:
        for signum, handler in signals.items():
            signal.signal(signum, handler)
        for handler in root.handlers:  # main's, writing to this run's files
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
    Path(folder, f"exit_code.rank{rank}").write_text(str(code))


def logged(folder: Path) -> str:
    """What rank 0 of a finished run logged (what run_train.sh shows); the run must have exited with 0."""
    assert (folder / "exit_code.rank0").read_text() == "0", (folder / "stderr.rank0.txt").read_text()[-3000:]
    return (folder / "stderr.rank0.txt").read_text()


def losses(folder: Path) -> dict[int, float]:
    """A finished run's losses by step; the run must have exited with 0."""
    logged(folder)
    return runs.losses(folder / "run")
