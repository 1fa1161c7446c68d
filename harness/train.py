"""Entry point: `python -m harness.train [--config FILE] [--section.key value ...]` (run_train.sh wraps it).

Bad configuration is reported before any process group or output file exists: one `error:` line and
exit code 2. A diverged run (NaN / inf loss) exits with code 3 and saves nothing for that step.
"""

from __future__ import annotations

import logging
import os
import sys

from .config import ConfigError, exit_on_config_error, load_config, validate_parallelism


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = load_config(argv)
        validate_parallelism(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        _check_run_requirements(cfg)
    except ConfigError as err:
        exit_on_config_error(err)

    rank = int(os.environ.get("RANK", "0"))
    name = cfg.job.name.replace("%", "%%")  # the format string below is %-style
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[{name} %(asctime)s rank{rank}] %(message)s", datefmt="%H:%M:%S")
    from models.qwen35_moe.gated_delta_rule import FlaBackwardUnavailableError

    from .trainer import Trainer, TrainingDivergedError  # heavy imports only once the config is valid

    try:
        trainer = Trainer(cfg)
    except FlaBackwardUnavailableError as err:  # this machine's kernels, not the config: say what to install
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        trainer.train()
        if cfg.checkpoint.export_hf_at_end:
            trainer.export_hf()
    except TrainingDivergedError as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    finally:
        trainer.close()
    return 0


def _check_run_requirements(cfg) -> None:
    """Files the run needs and features it asks for, checked up front so a typo fails in a second."""
    p = cfg.parallelism
    if p.context_parallel_degree > 1 or p.expert_parallel_degree > 1:
        raise ConfigError("parallelism.context_parallel_degree and expert_parallel_degree > 1 are not "
                          "available in this build yet; set them to 1")
    if cfg.checkpoint.enable:
        raise ConfigError("checkpoint.enable = true: DCP checkpointing and resume are not available in this "
                          "build yet; set it to false (checkpoint.export_hf_at_end works without it)")
    t = cfg.training
    if t.dataset != "hf":
        if not t.dataset_path:
            raise ConfigError(f"training.dataset_path is empty; set it to a {t.dataset} file or folder")
        if not os.path.exists(t.dataset_path):
            raise ConfigError(f"training.dataset_path {t.dataset_path!r} does not exist; set it in the config "
                              "file or with --training.dataset_path PATH")
    for key, path in (("model.tokenizer_path", cfg.model.tokenizer_path), ("model.hf_config", cfg.model.hf_config),
                      ("checkpoint.initial_load_hf", cfg.checkpoint.initial_load_hf)):
        if path and not os.path.exists(path):
            raise ConfigError(f"{key} {path!r} does not exist; set it in the config file or with --{key} PATH")


if __name__ == "__main__":
    sys.exit(main())
