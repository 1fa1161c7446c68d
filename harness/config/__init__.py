"""Run configuration: one TOML file describes a run; any key can be overridden on the command line.

    cfg = load_config(["--config", "train_configs/debug_model.toml", "--training.steps", "100"])
    cfg = check_launch(argv, world_size)  # also the parallel layout and what the run reads: every problem at once
    layout = validate_parallelism(cfg, world_size)  # parallel degrees, global batch, accumulation

One module a job:
  schema.py            the sections and keys: dataclasses whose field comments are the documentation
  load.py              defaults, the TOML file, `--section.key value` overrides -> JobConfig; and back to TOML
  validate.py          the one validation pass: values, the parallel layout, what the run reads
  run_requirements.py  what the run reads, against the disk and the model (paths, flavor, tokenizer, CP / EP)
  renamed.py           old keys and values, still read with a notice; saved run configs read under today's names
  errors.py            ConfigError (every problem, numbered), which the entry points print as one `error:` line,
                       exit code 2
  help.py              `--help`
  resume.py            what a relaunch on a checkpoint changes (reads the LR schedule, which imports torch: not
                       imported here)
"""

from .errors import ConfigError, describe_problems
from .load import DEFAULT_CONFIG, check_launch, load_config, to_toml, with_absolute_paths, with_default_config
from .schema import (
                     ALL_KEYS,
                     INPUT_PATH_KEYS,
                     OUTPUT_PATH_KEYS,
                     SCHEMA,
                     ActivationCheckpoint,
                     Checkpoint,
                     Compile,
                     Debug,
                     Job,
                     JobConfig,
                     LRScheduler,
                     Metrics,
                     Model,
                     Optimizer,
                     Parallelism,
                     Profiling,
                     Training,
                     Validation,
)
from .validate import RunLayout, config_problems, validate_parallelism

__all__ = [
    "ALL_KEYS", "DEFAULT_CONFIG", "INPUT_PATH_KEYS", "OUTPUT_PATH_KEYS", "SCHEMA", "ActivationCheckpoint",
    "Checkpoint", "Compile", "ConfigError", "Debug", "Job", "JobConfig", "LRScheduler", "Metrics", "Model",
    "Optimizer", "Parallelism", "Profiling", "RunLayout", "Training", "Validation", "check_launch",
    "config_problems", "describe_problems", "load_config", "to_toml", "validate_parallelism",
    "with_absolute_paths", "with_default_config",
]
