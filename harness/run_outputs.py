"""The outputs a dump folder holds for one line of training, and what a launch does with those of another line.

A line of training is a run and every relaunch that resumes its checkpoints. Its id (`new_run_id`: the start time
and a random suffix) is saved in each checkpoint it writes and names its TensorBoard folder, tb/<id>. The dump
folder's metrics.jsonl, config.toml, hf/ (the end-of-run export) and hf-adapter/ (a LoRA run's) belong to one line, the one run.json beside them
names. A launch makes them its own line's before it writes any (`claim_outputs`, rank 0):

- resuming a checkpoint of the line run.json names: nothing moves (metrics.jsonl then keeps its records up to the
  checkpoint's step: harness/metrics.py), but for the line's own outputs a launch killed midway left aside, which
  come back;
- starting afresh (nothing to resume), or resuming a checkpoint of another line: the outputs there are moved aside
  under names carrying their line's id (metrics-<id>.jsonl, config-<id>.toml, hf-<id>/), with one log line (deleted
  instead where job.other_run_outputs = "delete"); a resume then moves its own line's back from where an earlier
  launch set them aside.

All or nothing: the renames come first and run.json naming the line last; a launch refused midway (a full disk)
renames back what it moved, so the next launch finds the folder as this one found it.

So a fresh relaunch never empties another run's metrics or replaces its export, and a resume continues exactly the
records of its own line. Nothing is deleted unless asked; a rename moves a link itself, never what it points to. Outputs found
without a run.json (written before lines were named) count as their own unnamed line, named by their time
("earlier-<time>") when set aside; a checkpoint saved before lines were named continues the folder's line as it is.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from pathlib import Path

from .atomic_file import write_whole

RUN_FILE = "run.json"
ADAPTER_SUFFIX = "-adapter"  # a LoRA export's PEFT adapter, beside its merged model (`adapter_folder`)
METRICS, CONFIG, EXPORT = "metrics.jsonl", "config.toml", "hf"
ADAPTER = EXPORT + ADAPTER_SUFFIX
OUTPUTS = (METRICS, CONFIG, EXPORT, ADAPTER)


class OutputError(RuntimeError):
    """A file of the run's dump folder that the file system refused (a full disk, no permission): harness/train.py
    prints it as one `error:` line and exits 2 (from rank 0 alone when `every_rank`: a verdict all ranks share)."""

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


def adapter_folder(export_folder: str | Path) -> str:
    """Where the PEFT adapter of a merged export goes: beside it, `<export_folder>-adapter` (`.` and `..` taken as
    the folders they name): <dump_folder>/hf-adapter for the end of a run, <out>-adapter for the converter's."""
    return os.path.abspath(export_folder) + ADAPTER_SUFFIX


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def set_aside_name(name: str, run_id: str) -> str:
    """metrics.jsonl -> metrics-<id>.jsonl, config.toml -> config-<id>.toml, hf -> hf-<id>."""
    stem, dot, suffix = name.partition(".")
    return f"{stem}-{run_id}{dot}{suffix}"


def claim_outputs(folder: str | Path, line: str | None, resumed: bool, model: str,
                  keep_others: bool = True, keep_newest: int = 0) -> tuple[str, str | None]:
    """Make the dump folder's outputs those of line `line` (the resumed checkpoint's; None: a fresh start, or a
    checkpoint saved before lines were named). Returns the line's id (new for a fresh start) and the log line saying
    what was set aside, deleted (`keep_others` False: job.other_run_outputs = "delete") or brought back (None when
    nothing moved). `model` describes the run, for the next launch's line. `keep_newest` (job.other_run_outputs_keep;
    0: all): how many earlier lines' set-aside outputs stay, the newest; the older ones are deleted.

    All or nothing: the renames, then run.json naming the line; a failure anywhere (a full disk refusing run.json)
    renames back what had moved, so the folder is as the launch found it, and raises OutputError. Another line's
    outputs are deleted only once run.json names this one (set aside first, then deleted)."""
    folder = Path(folder)
    done: list[tuple[str, str]] = []  # (from, to) of every rename made, to undo on failure
    moved, restored = [], []
    try:
        current = _read_run_file(folder)
        if resumed and (line is None or (current is not None and current["run"] == line)):
            line = line or (current["run"] if current is not None else new_run_id())  # the folder's line goes on
            # its own outputs, if a launch that died between its renames and run.json left them aside
            restored = [_rename(folder, set_aside_name(name, line), name, done) for name in OUTPUTS
                        if not os.path.lexists(folder / name) and os.path.lexists(folder / set_aside_name(name, line))]
        else:
            line = line or new_run_id()
            present = [name for name in OUTPUTS if os.path.lexists(folder / name)]
            other = current["run"] if current is not None else _unnamed(folder, present)
            moved = [_rename(folder, name, set_aside_name(name, other), done) for name in present]
            if resumed:
                restored = [_rename(folder, set_aside_name(name, line), name, done) for name in OUTPUTS
                            if os.path.lexists(folder / set_aside_name(name, line))]
        if current is None or current["run"] != line:
            write_whole(folder / RUN_FILE, json.dumps({"run": line, "model": model}) + "\n")
    except OSError as e:
        undone = _undo(folder, done)
        raise OutputError(f"cannot set up the outputs of dump folder {folder}: {e}; {undone}. Free space or fix its "
                          "permissions, or choose another job.dump_folder") from None
    if not keep_others:
        originals = dict((target, source) for source, target in done)
        try:
            moved = [originals[_delete(folder, name)] for name in moved]
        except OSError as e:
            raise OutputError(f"cannot delete another run's outputs in dump folder {folder} (job.other_run_outputs = "
                              f"'delete'): {e}; what was not deleted is kept aside under its run's id") from None
    pruned = _prune_set_aside(folder, keep_newest, line) if keep_others and keep_newest else []
    if not moved and not restored and not pruned:
        return line, None
    return line, _describe(folder, current, moved, restored, model, keep_others, pruned, keep_newest)


# An output set aside under its line's id (set_aside_name; a suffix where the name was taken): its line's id
_SET_ASIDE = re.compile(r"(?:metrics|config|hf|hf-adapter)-(\d{8}-\d{6}-[0-9a-f]{4}|earlier-\d{8}-\d{6})"
                        r"(?:\.\d+)?(?:\.jsonl|\.toml)?", re.ASCII)


def _prune_set_aside(folder: Path, keep: int, line: str) -> list[str]:
    """Delete the set-aside outputs of all but the `keep` newest earlier lines (by when their files were last
    written), never those of `line`, this run's; returns the names deleted. A failure is an OutputError: what was not
    deleted stays aside."""
    lines: dict[str, list[str]] = {}
    for entry in folder.iterdir():
        if (match := _SET_ASIDE.fullmatch(entry.name)) is not None and match.group(1) != line:
            lines.setdefault(match.group(1), []).append(entry.name)
    def last_written(run_id: str) -> float:
        return max(os.lstat(folder / name).st_mtime_ns for name in lines[run_id])

    oldest_first = sorted(lines, key=last_written)
    try:
        return [_delete(folder, name) for run_id in oldest_first[:max(0, len(lines) - keep)]
                for name in sorted(lines[run_id])]
    except OSError as e:
        raise OutputError(f"cannot delete earlier runs' outputs in dump folder {folder} (job.other_run_outputs_keep "
                          f"= {keep}): {e}; what was not deleted stays aside") from None


def _undo(folder: Path, done: list[tuple[str, str]]) -> str:
    """Rename back, newest first, what `claim_outputs` renamed; says what the folder holds then."""
    failed = []
    for source, target in reversed(done):
        try:
            os.rename(folder / target, folder / source)
        except OSError:
            failed.append(f"{target} (was {source})")
    if failed:
        return "these could not be renamed back: " + ", ".join(failed)
    return "nothing there was moved" if not done else "every output there is back under its own name"


def _describe(folder: Path, current: dict | None, moved: list[str], restored: list[str], model: str,
              kept: bool, pruned: list[str], keep_newest: int) -> str:
    held = f"the run {current['run']} ({current.get('model', '?')})" if current is not None else "an earlier run"
    parts = []
    if moved:
        done = "kept as" if kept else "deleted (job.other_run_outputs = 'delete'):"
        parts.append(f"{folder} held the outputs of {held}: {done} {', '.join(moved)}")
    if restored:
        parts.append(f"this run's own, set aside by an earlier launch, are back: {', '.join(restored)}")
    if pruned:
        parts.append(f"older runs' outputs beyond the newest {keep_newest} deleted (job.other_run_outputs_keep): "
                     f"{', '.join(pruned)}")
    text = "; ".join(parts) + f" (this run: {model})"
    if moved and kept and not keep_newest:
        text += (". Outputs set aside are kept until deleted: delete them by hand, or set "
                 "job.other_run_outputs_keep = N to keep the newest N runs' (job.other_run_outputs = 'delete': none)")
    return text


def _read_run_file(folder: Path) -> dict | None:
    try:
        record = json.loads((folder / RUN_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # unreadable or damaged: its outputs count as an unnamed line's
        return None
    return record if isinstance(record, dict) and isinstance(record.get("run"), str) else None


def _unnamed(folder: Path, present: list[str]) -> str:
    """An id for outputs written before lines were named: the time of the newest of them."""
    newest = max((os.lstat(folder / name).st_mtime for name in present), default=time.time())
    return "earlier-" + time.strftime("%Y%m%d-%H%M%S", time.localtime(newest))


def _delete(folder: Path, name: str) -> str:
    """`name` deleted from `folder` (a link itself, never what it points to); returns the name."""
    path = folder / name
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
    return name


def _rename(folder: Path, name: str, new: str, done: list[tuple[str, str]]) -> str:
    """`name` renamed to `new` in `folder` (never over an existing entry: a suffix is added), recorded in `done`;
    returns the name."""
    target, n = new, 1
    while os.path.lexists(folder / target):
        stem, dot, suffix = new.partition(".")
        target, n = f"{stem}.{n}{dot}{suffix}", n + 1
    os.rename(folder / name, folder / target)
    done.append((name, target))
    return target
