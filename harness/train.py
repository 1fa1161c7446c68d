"""Worker entry point: `python -m harness.train [--config FILE] [--section.key value ...]`, one per rank (launched
by harness/launch.py, which run_train.sh wraps, or by torchrun directly). `--help` lists every key.

Exit codes: 0 done; 2 bad input (one `error:` line, printed before any process group or output file exists,
or a machine that cannot run the kernels); 3 diverged (NaN / inf loss; nothing saved for that step). Under a
launcher that sets QWEN35_EXIT_DIR, a failing rank writes its code there, so the launcher can exit with it
instead of torchrun's generic 1.
"""

from __future__ import annotations

import logging
import os
import sys

from .config import ConfigError, load_config, validate_parallelism
from .preflight import check_run_requirements

BAD_INPUT, DIVERGED = 2, 3


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        from .config_help import config_help

        print(config_help())
        return 0
    try:
        cfg = load_config(argv)
        validate_parallelism(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        check_run_requirements(cfg)
    except ConfigError as err:
        return _fail(BAD_INPUT, err)

    rank = int(os.environ.get("RANK", "0"))
    name = cfg.job.name.replace("%", "%%")  # the format string below is %-style
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[{name} %(asctime)s rank{rank}] %(message)s", datefmt="%H:%M:%S", force=True)
    from models.qwen35_moe.gated_delta_rule import FlaKernelsUnavailableError

    from .trainer import Trainer, TrainingDivergedError  # heavy imports only once the config is valid

    try:
        trainer = Trainer(cfg)
    except FlaKernelsUnavailableError as err:  # this machine's kernels, not the config: say what to install
        return _fail(BAD_INPUT, err)
    try:
        trainer.train()
        if cfg.checkpoint.export_hf_at_end:
            trainer.export_hf()
        trainer.print_summary()
    except TrainingDivergedError as err:
        return _fail(DIVERGED, err)
    finally:
        trainer.close()
    return 0


def _fail(code: int, err: Exception) -> int:
    print(f"error: {err}", file=sys.stderr, flush=True)
    exit_dir = os.environ.get("QWEN35_EXIT_DIR")
    if exit_dir:  # tell the launcher why this rank stops (torchrun itself only reports "failed")
        with open(os.path.join(exit_dir, f"rank{os.environ.get('RANK', '0')}"), "w") as f:
            f.write(str(code))
    return code


if __name__ == "__main__":
    sys.exit(main())
