"""Where a run writes, and the overlaps between its folders and other runs' refused before it starts.

A run writes into its dump folder (metrics.jsonl, config.toml, run.json, hf/, hf-adapter/, tb/, the dataset cache),
its checkpoint folder, and the TensorBoard and profiling folders where a path leads them out of the dump folder
(`written_folders`: each one is locked, harness/run_lock.py). Some of them are replaced whole or moved aside by the
run itself (an export replaces hf/; a fresh launch sets another line's hf/ and metrics.jsonl aside) or by another
run. So, before anything is written (`folder_problems`, part of the config's one validation pass):

- the checkpoint folder is not the dump folder, does not hold it, and neither is nor lies inside one of the run's
  own outputs; nor is it, or does it lie inside or hold, another run's dump folder (a folder holding run.json);
- the dump folder does not lie inside another run's outputs (its hf/, hf-adapter/, tb/, checkpoint/, ...).

Runs that are running are the lock's business: a run's lock covers what lies under its dump folder
(harness/run_lock.py refuses a folder inside a held one, or holding one).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

from .run_outputs import OUTPUTS, RUN_FILE

# What else a dump folder holds that is not the run's to put a checkpoint in: the export's temporary and set-aside
# folders (models/qwen35_moe/hf_checkpoint.py), the outputs of other lines set aside (harness/run_outputs.py), the
# damaged metrics lines kept aside (harness/metrics.py) and the default dataset cache.
_OTHER_OUTPUTS = re.compile(r"(hf|hf-adapter)(\.tmp|\.old|-.+)|metrics-.+\.jsonl|config-.+\.toml|dataset_cache",
                            re.ASCII)
# Another run's outputs by their default names (its own config may name others: these are the ones a user meets)
_DEFAULT_OUTPUTS = (*OUTPUTS, "tb", "checkpoint", "profile_traces", "memory_snapshot", "dataset_cache")
WALK_LIMIT = 10_000  # folders looked into under a folder for another run's (folders_under)


def written_folders(cfg) -> dict[str, str]:
    """{config key: folder} of every folder a run of `cfg` writes into and locks: the dump folder, the checkpoint
    folder (when checkpointing), and the TensorBoard / profiling folders that lie outside the dump folder."""
    dump = cfg.job.dump_folder
    folders = {"job.dump_folder": dump}
    if cfg.checkpoint.enable:
        folders["checkpoint.folder"] = os.path.join(dump, cfg.checkpoint.folder)
    inside = os.path.realpath(dump) + os.sep
    for key, enabled, folder in _optional_outputs(cfg):
        path = os.path.join(dump, folder)
        if enabled and not (os.path.realpath(path) + os.sep).startswith(inside):
            folders[key] = path
    return folders


def _optional_outputs(cfg) -> tuple[tuple[str, bool, str], ...]:
    return (("metrics.save_tb_folder", cfg.metrics.enable_tensorboard, cfg.metrics.save_tb_folder),
            ("profiling.save_traces_folder", cfg.profiling.enable_profiling, cfg.profiling.save_traces_folder),
            ("profiling.save_memory_snapshot_folder", cfg.profiling.enable_memory_snapshot,
             cfg.profiling.save_memory_snapshot_folder))


def _own_outputs(cfg) -> dict[str, str]:
    """{the real path of each output the run writes under its dump folder: what it is}."""
    dump = cfg.job.dump_folder
    named = {name: f"output {name}" for name in (*OUTPUTS, RUN_FILE)}
    named |= {folder: key for key, enabled, folder in _optional_outputs(cfg) if enabled}
    cache = cfg.training.dataset_cache_dir or "dataset_cache"
    named[cache] = "training.dataset_cache_dir"
    return {os.path.realpath(os.path.join(dump, name)): what for name, what in named.items()}


def _within(path: str, folder: str) -> bool:
    """Whether real path `path` is `folder` or lies under it."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def folder_problems(cfg) -> list[str]:
    """What is wrong with where the run of `cfg` writes (see the module's docstring), each naming the key to change."""
    dump = os.path.realpath(cfg.job.dump_folder)
    problems = []
    if cfg.checkpoint.enable:
        problem = _checkpoint_folder_problem(cfg, dump, os.path.realpath(os.path.join(cfg.job.dump_folder,
                                                                                      cfg.checkpoint.folder)))
        problems += [problem] if problem else []
    problem = _inside_another_runs_output(dump)
    if problem:
        problems.append(f"job.dump_folder {cfg.job.dump_folder!r} {problem}: choose a folder outside it")
    return problems


def _checkpoint_folder_problem(cfg, dump: str, ckpt: str) -> str | None:
    named = f"checkpoint.folder {cfg.checkpoint.folder!r} ({ckpt})"
    if _within(dump, ckpt):
        return (f"{named} {'is' if dump == ckpt else 'holds'} the dump folder {dump}, whose outputs a fresh launch "
                "moves aside and an export replaces: name a folder of its own (the default: checkpoint)")
    for output, what in _own_outputs(cfg).items():
        if _within(ckpt, output):
            return (f"{named} {'is' if ckpt == output else 'lies inside'} the run's own {what}, which the run "
                    "replaces or moves aside: name a folder of its own (the default: checkpoint)")
    relative = os.path.relpath(ckpt, dump)
    if not relative.startswith(os.pardir) and _OTHER_OUTPUTS.fullmatch(relative.split(os.sep)[0]):
        return (f"{named} lies inside {relative.split(os.sep)[0]}, an output this program writes or sets aside in "
                "the dump folder: name a folder of its own (the default: checkpoint)")
    other = _dump_folder_above(ckpt, stop=dump)
    if other is not None:
        return (f"{named} {'is' if other == ckpt else 'lies inside'} {other}, another run's dump folder (it holds "
                f"{RUN_FILE}): name a folder of this run's")
    other = _dump_folder_below(ckpt)
    if other is not None:
        return f"{named} holds {other}, another run's dump folder (it holds {RUN_FILE}): name a folder of this run's"
    return None


def _dump_folder_above(path: str, stop: str) -> str | None:
    """The nearest folder at or above `path` that holds run.json, not counting `stop` and the folders above it."""
    folder = path
    while not _within(stop, folder):
        if os.path.isfile(os.path.join(folder, RUN_FILE)):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent
    return None


def folders_under(path: str) -> Iterator[tuple[str, list[str]]]:
    """(folder, the names of its files) of `path` and the folders under it where another run's folder could lie:
    the first WALK_LIMIT, step folders and checkpoints set aside not entered (a checkpoint holds no run's folder),
    never through a link."""
    for seen, (root, dirs, files) in enumerate(os.walk(path)):
        if seen >= WALK_LIMIT:
            return
        dirs[:] = [d for d in dirs if not d.startswith(("step-", "abandoned-"))]
        yield root, files


def _dump_folder_below(path: str) -> str | None:
    """A folder under `path` that holds run.json (folders_under), or None."""
    return next((root for root, files in folders_under(path) if root != path and RUN_FILE in files), None)


def _inside_another_runs_output(dump: str) -> str | None:
    """Whether the dump folder lies inside an output of another run's dump folder (by its default names)."""
    child, folder = dump, os.path.dirname(dump)
    while True:
        if os.path.isfile(os.path.join(folder, RUN_FILE)):
            output = os.path.basename(child)
            if output in _DEFAULT_OUTPUTS or _OTHER_OUTPUTS.fullmatch(output):
                return f"lies inside {child}, an output of the run whose dump folder is {folder}"
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        child, folder = folder, parent
