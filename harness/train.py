"""Worker entry point: `python -m harness.train [--config FILE] [--section.key value ...]`, one per rank (launched
by harness/launch.py, which run_train.sh wraps, or by torchrun directly); without --config, the embedded default
(train_configs/debug_model.toml), as run_train.sh. `--help` lists every key.

Exit codes: 0 done, or stopped by SIGTERM (after saving a checkpoint when checkpointing is on); 2 bad input
(one `error:` line, printed before any process group or output file exists; or a checkpoint that cannot be
resumed, or a machine that cannot run the kernels); 3 diverged (NaN / inf loss; nothing saved for that step);
130 interrupted by Ctrl-C (one line; saved first unless Ctrl-C was pressed twice). Under a launcher that sets
QWEN35_EXIT_DIR, a rank that stops for one of these reasons writes its code there, so the launcher can exit
with it instead of torchrun's generic 1.
"""

from __future__ import annotations

import gc
import logging
import os
import sys

from .config import ConfigError, load_config, validate_parallelism, with_default_config
from .preflight import check_run_requirements

BAD_INPUT, DIVERGED, INTERRUPTED = 2, 3, 130
STARTING = "interrupted while starting; nothing saved"


def main(argv: list[str] | None = None) -> int:
    argv = with_default_config(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        from .config_help import config_help

        print(config_help(argv))
        return 0
    try:
        cfg = load_config(argv)
        validate_parallelism(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        check_run_requirements(cfg)
    except ConfigError as err:
        return _fail(BAD_INPUT, err)

    rank = int(os.environ.get("RANK", "0"))
    name = cfg.job.name.replace("%", "%%")  # the format string below is %-style
    logging.basicConfig(level=logging.WARNING, format=f"[{name} %(asctime)s rank{rank}] %(message)s",
                        datefmt="%H:%M:%S", force=True)
    for ours in ("harness", "models", "parallel"):  # the project's own progress lines; libraries' warnings only
        logging.getLogger(ours).setLevel(logging.INFO if rank == 0 else logging.WARNING)
    try:  # heavy imports only once the config is valid; Ctrl-C while they load is a stop like any other
        from models.qwen35_moe.kernels.gated_delta_rule import FlaKernelsUnavailableError

        from .checkpoint.checkpointer import CheckpointError
        from .data.loader import DataError
        from .preemption import TERMINATED, TrainingStopped
        from .trainer import Trainer, TrainingDivergedError
    except KeyboardInterrupt:
        return _stop(INTERRUPTED, STARTING)

    try:
        trainer = Trainer(cfg)
    except (FlaKernelsUnavailableError, CheckpointError, DataError) as err:  # the machine, dump folder or data
        return _fail(BAD_INPUT, err)
    except KeyboardInterrupt:
        return _stop(INTERRUPTED, STARTING)
    trainer.stop.install()
    try:
        trainer.train()
        if cfg.checkpoint.export_hf_at_end:
            trainer.export_hf()
        trainer.print_summary()
    except TrainingDivergedError as err:
        return _fail(DIVERGED, err)
    except CheckpointError as err:  # a save or the export the file system refused (a full disk)
        return _fail(BAD_INPUT, err)
    except TrainingStopped as stopped:
        return _stop(0 if stopped.reason == TERMINATED else INTERRUPTED, str(stopped))
    except KeyboardInterrupt:  # a second Ctrl-C: no save
        return _stop(INTERRUPTED, f"interrupted at step {trainer.step}; not saved (Ctrl-C twice)")
    finally:
        trainer.close()
    return 0


def _stop(code: int, message: str) -> int:
    """A deliberate stop: one line (not an error), and the code for the launcher."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, file=sys.stderr, flush=True)
    _record_exit(code)
    return code


def _fail(code: int, err: Exception) -> int:
    print(f"error: {err}", file=sys.stderr, flush=True)
    _record_exit(code)
    return code


def _record_exit(code: int) -> None:
    exit_dir = os.environ.get("QWEN35_EXIT_DIR")
    if exit_dir:  # tell the launcher why this rank stops (torchrun itself only reports "failed")
        with open(os.path.join(exit_dir, f"rank{os.environ.get('RANK', '0')}"), "w") as f:
            f.write(str(code))


if __name__ == "__main__":
    try:
        code = main()
    except KeyboardInterrupt:  # before the handlers above are in place (reading the config)
        code = _stop(INTERRUPTED, STARTING)
    # Collect the finished trainer, and with it its process groups, while the interpreter is whole: a gloo worker
    # thread still dropping its last collective once finalization has begun takes the GIL, is killed by Python,
    # and aborts the process ("terminate called without an active exception", exit -6), at random under CPU load.
    gc.collect()
    sys.exit(code)
