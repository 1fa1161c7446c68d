"""Worker entry point: `python -m harness.train [--config FILE] [--section.key value ...]`, one per rank (launched
by harness/launch.py, which run_train.sh wraps, or by torchrun directly); without --config, the embedded default
(train_configs/debug_model.toml), as run_train.sh. `--help` lists every key.

Exit codes (what each means for a user: README, "Configuration"): BAD_INPUT, DIVERGED, INTERRUPTED and
TERMINATED_STARTING below; every bad input is one `error:` line, printed by rank 0 alone where every rank met it.
Under a launcher that sets QWEN35_EXIT_DIR, each rank writes its pid there
as it starts, so the launcher can pass signals on to it, and a rank that stops for one of these reasons writes its
code there, so the launcher can exit with it instead of torchrun's generic 1, and its `error:` line, so the
launcher can show it when that rank's output is not shown (LOG_RANK). A rank whose collective breaks because
another rank already stopped for such a reason (bad data met by one rank alone, mid-training), or that torchrun
ends while it is still starting, adds nothing: that rank's line is the run's one error, not this rank's traceback of
a closed connection nor its own SIGTERM.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from .atomic_file import write_whole
from .config import ConfigError, check_launch, with_default_config

BAD_INPUT, DIVERGED, INTERRUPTED, TERMINATED_STARTING = 2, 3, 130, 143  # 143: 128 + SIGTERM, as the shell reports
STARTING = "interrupted while starting; nothing saved"
SHARED_ERROR_GRACE_S = 3.0  # how long a rank that leaves an error to rank 0 waits before it exits
# in QWEN35_EXIT_DIR: a rank's pid; the signal the launcher received; a rank's exit code; its `error:` line
PID_FILE, STOP_FILE, EXIT_FILE, ERROR_FILE = "pid.rank", "stop", "rank", "error.rank"
TERMINATED_WHILE_STARTING = "stopped on SIGTERM while starting; nothing saved"


class Terminated(BaseException):
    """SIGTERM before the trainer's own handler is in place. A BaseException, like KeyboardInterrupt: it unwinds
    start-up (the `finally` of a dataset cache build removes its temporary folder) past every `except Exception`."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        return _main(argv)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)  # until trainer.stop.install() replaces it
    try:
        return _main(argv)
    finally:
        if signal.getsignal(signal.SIGTERM) is _raise_terminated:  # a caller running several launches in-process
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    try:
        _record_pid()  # may take a signal the launcher received before this rank started
    except KeyboardInterrupt:
        return _stop(INTERRUPTED, STARTING)
    except Terminated:
        return _terminated_starting()
    argv = with_default_config(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        from .config.help import config_help

        print(config_help(argv))
        return 0
    try:
        cfg = check_launch(argv, int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as err:  # the same on every rank: rank 0 names it
        return _fail(BAD_INPUT, err, shared=True)

    rank = int(os.environ.get("RANK", "0"))
    name = cfg.job.name.replace("%", "%%")  # the format string below is %-style
    logging.basicConfig(level=logging.WARNING, format=f"[{name} %(asctime)s rank{rank}] %(message)s",
                        datefmt="%H:%M:%S", force=True, stream=_Stderr())
    for ours in ("harness", "models", "parallel"):  # the project's own progress lines; libraries' warnings only
        logging.getLogger(ours).setLevel(logging.INFO if rank == 0 else logging.WARNING)
    try:  # heavy imports only once the config is valid; Ctrl-C while they load is a stop like any other
        from models.qwen35_moe.kernels.gated_delta_rule import FlaKernelsUnavailableError

        from .checkpoint.errors import CheckpointError
        from .data.loader import DataError
        from .preemption import TERMINATED, TrainingStopped
        from .run_lock import RunLockError
        from .run_outputs import OutputError
        from .trainer import Trainer, TrainingDivergedError
    except KeyboardInterrupt:
        return _stop(INTERRUPTED, STARTING)
    except Terminated:
        return _terminated_starting()

    try:
        trainer = Trainer(cfg)
    except (RunLockError, ConfigError) as err:  # rank 0's verdict, or every rank's own on the same config
        code = _fail(BAD_INPUT, err, shared=True)
    except (FlaKernelsUnavailableError, CheckpointError, DataError, OutputError) as err:  # machine, folders, data
        code = _fail(BAD_INPUT, err, shared=getattr(err, "every_rank", False))
    except KeyboardInterrupt:
        code = _stop(INTERRUPTED, STARTING)
    except Terminated:
        code = _terminated_starting()
    else:
        code = None
    if code is not None:
        # The trainer that failed to start may hold the run lock: it is garbage now (only the exception's frames
        # held it), freed here even if it sits in a reference cycle, so that a caller that launches again in this
        # process finds the folder free.
        gc.collect()
        return code
    trainer.stop.install()
    try:
        trainer.train()
        if cfg.checkpoint.export_hf_at_end:
            trainer.export_hf()  # a first Ctrl-C or SIGTERM meanwhile lets it finish: it may be all that is saved
        trainer.print_summary()
        if trainer.stop.reason and cfg.checkpoint.export_hf_at_end:  # past the last step's stop check
            what = "stopped on SIGTERM" if trainer.stop.reason == TERMINATED else "interrupted"
            return _stop(0 if trainer.stop.reason == TERMINATED else INTERRUPTED,
                         f"{what} after the last step; the Hugging Face export was finished first: "
                         f"{trainer.export_folder}")
    except TrainingDivergedError as err:
        return _fail(DIVERGED, err)
    except (DataError, CheckpointError, OutputError) as err:  # a damaged row; a save or a write the disk refused
        return _fail(BAD_INPUT, err, shared=getattr(err, "every_rank", False))
    except TrainingStopped as stopped:
        return _stop(0 if stopped.reason == TERMINATED else INTERRUPTED, str(stopped))
    except KeyboardInterrupt:  # a second Ctrl-C: no save, no export; what is on disk is said
        return _stop(INTERRUPTED, f"interrupted at step {trainer.step} (Ctrl-C twice): {trainer.what_is_saved()}")
    except Exception:
        peer = _peer_stopped()
        if peer is None:
            raise
        return peer  # silently: that rank's line says why (the launcher exits with its code)
    finally:
        trainer.close()
    return 0


class _Stderr:
    """sys.stderr as it is when a line is logged, not when logging was set up: a caller that swaps it (pytest's
    capture, a second launch in one process) never leaves the log writing to a closed stream."""

    def write(self, text: str) -> None:
        sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _stop(code: int, message: str) -> int:
    """A deliberate stop: one line (not an error), and the code for the launcher."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, file=sys.stderr, flush=True)
    _record_exit(code)
    return code


def _terminated_starting() -> int:
    """SIGTERM before the trainer's handler is in place. Where another rank already stopped for a known reason, it is
    torchrun ending a run that failed (it stops every worker once one exits with an error, and a rank still starting
    under CPU load meets it here): that rank's code, silently, as a rank whose collective broke with it."""
    peer = _peer_stopped()
    if peer is not None:
        return peer
    return _stop(TERMINATED_STARTING, TERMINATED_WHILE_STARTING)


def _fail(code: int, err: Exception, shared: bool = False) -> int:
    """An error: one `error:` line, from every rank that met it, or from rank 0 alone when all ranks met the same
    (`shared`: a config every rank read, a verdict rank 0 sent them)."""
    line = f"error: {err}"
    printed = not shared or int(os.environ.get("RANK", "0")) == 0
    if printed:
        print(line, file=sys.stderr, flush=True)
    _record_exit(code, line if printed else None)
    if shared and int(os.environ.get("RANK", "0")) != 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # torchrun stops every worker once one exits with an error: leave rank 0 the time to print the line, and
        # take torchrun's SIGTERM meanwhile as what it is, the end of a run that has already failed
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(SHARED_ERROR_GRACE_S)
    return code


def _record_pid() -> None:
    """Under the launcher: this rank's pid, for it to pass signals on (harness/launch.py, SignalForwarder), written
    whole by a rename; then the signal it received before it knew this rank, if any, taken now."""
    exit_dir = os.environ.get("QWEN35_EXIT_DIR")
    if not exit_dir:
        return
    write_whole(os.path.join(exit_dir, f"{PID_FILE}{os.environ.get('RANK', '0')}"), str(os.getpid()))
    try:  # the launcher writes `stop` before it reads the pids: it has signalled this rank, or this rank sees it
        with open(os.path.join(exit_dir, STOP_FILE)) as f:
            os.kill(os.getpid(), int(f.read()))
    except FileNotFoundError:
        pass


def _record_exit(code: int, error: str | None = None) -> None:
    """Tell the launcher why this rank stops (torchrun itself only reports "failed"): its code and error line, each
    written whole (another rank may read them at once, `_peer_stopped`), the line first."""
    exit_dir = os.environ.get("QWEN35_EXIT_DIR")
    if exit_dir:
        rank = os.environ.get("RANK", "0")
        if error is not None:
            write_whole(os.path.join(exit_dir, f"{ERROR_FILE}{rank}"), error)
        write_whole(os.path.join(exit_dir, f"{EXIT_FILE}{rank}"), str(code))


def recorded(exit_dir: str | Path, what: str) -> dict[int, str]:
    """{rank: text} of the records `_record_exit` left in exit_dir: what = EXIT_FILE (codes) or ERROR_FILE (lines)."""
    return {int(p.name.removeprefix(what)): p.read_text() for p in Path(exit_dir).glob(f"{what}[0-9]*")}


def _peer_stopped() -> int | None:
    """The exit code another rank of this node recorded, if one stopped for a known reason (its record is written
    before it exits, so before its peers' collectives with it break); None if none did."""
    exit_dir = os.environ.get("QWEN35_EXIT_DIR")
    if not exit_dir:
        return None
    mine = int(os.environ.get("RANK", "0"))
    codes = [int(code) for rank, code in recorded(exit_dir, EXIT_FILE).items() if rank != mine]
    failed = [code for code in codes if code != 0]  # a peer that stopped cleanly explains no broken collective
    return max(failed) if failed else None


if __name__ == "__main__":
    try:
        code = main()
    except KeyboardInterrupt:  # before the handlers above are in place (reading the config)
        code = _stop(INTERRUPTED, STARTING)
    except Terminated:
        code = _terminated_starting()
    # Collect the finished trainer, and with it its process groups, while the interpreter is whole: a gloo worker
    # thread still dropping its last collective once finalization has begun takes the GIL, is killed by Python,
    # and aborts the process ("terminate called without an active exception", exit -6), at random under CPU load.
    gc.collect()
    sys.exit(code)
