"""The step folders of a checkpoint folder: which are checkpoints, which one a launch resumes, and what is set aside
(docs/design.md, "Checkpoints").

Resume: the newest complete checkpoint whose files match COMPLETE's digests (each rank checks its share, the ranks
agree), else the next older one, each failure logged in one line; `checkpoint.load_step` picks one and rolls back.
Complete checkpoints newer than the one resumed are moved aside into abandoned-<UTC time>/, where pruning, which looks
only at step-N folders directly under the checkpoint folder, never goes. A step-N that is a symbolic link, or that
cannot be read, fails verification like a damaged one; nothing here acts through a link.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .errors import CheckpointError, agreed, first_cause, one_line, rank_world
from .integrity import COMPLETE, check_files, hash_threads, read_complete
from .plain_state import from_bytes

logger = logging.getLogger(__name__)

# A step folder's name: ASCII digits, no leading zero, nothing after them (not even a newline). `\d` would take
# Arabic-Indic or full-width digits and `$` a trailing newline, and int() reads them all: "step-06" or "step-٦"
# would stand for step-6, a folder that does not exist.
_STEP_FOLDER = re.compile(r"step-(0|[1-9][0-9]*)", re.ASCII)
ABANDONED = "abandoned-"  # + UTC time: checkpoints moved aside by a rollback or a failed verification


def _step_entries(folder: Path) -> dict[int, Path]:
    """{step: path} of every step-N entry directly under `folder`, complete or not: folders, and symbolic links
    (never followed: a link is no checkpoint of this run, and nothing here acts through one)."""
    try:
        entries = list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return {}
    return {int(m.group(1)): p for p in entries
            if (m := _STEP_FOLDER.fullmatch(p.name)) and (p.is_symlink() or p.is_dir())}


def _misnamed(folder: Path) -> list[str]:
    """Entries under `folder` whose names start like a step's but are not one (`step-06`, `step-٦`, a trailing
    newline): never read, pruned or set aside."""
    try:
        return sorted(repr(p.name) for p in folder.iterdir()
                      if p.name.startswith("step-") and not _STEP_FOLDER.fullmatch(p.name))
    except (FileNotFoundError, NotADirectoryError):
        return []


def is_complete(path: Path) -> bool | None:
    """Whether a step folder holds its COMPLETE; None when that cannot be read (a folder without read permission)."""
    try:
        return (path / COMPLETE).is_file()
    except OSError:
        return None


def step_dirs(folder: Path) -> dict[int, Path]:
    """{step: folder} of every step-N folder directly under `folder` (links left out), complete or not."""
    return {step: p for step, p in _step_entries(folder).items() if not p.is_symlink()}


def step_folders(folder: str | Path) -> dict[int, Path]:
    """{step: folder} of the complete checkpoints under `folder` (folders of their own, whose COMPLETE is there)."""
    return {step: path for step, path in step_dirs(Path(folder)).items() if is_complete(path)}


def _resume_candidates(folder: Path) -> dict[int, Path]:
    """What a resume considers: the complete checkpoints, and every step-N that looks like one but cannot be checked
    (a link, a folder that cannot be read), so that verification names it and, when newer than the step resumed,
    sets it aside instead of leaving it to a later save or pruning."""
    return {step: path for step, path in _step_entries(folder).items()
            if path.is_symlink() or is_complete(path) is not False}


def _problem(path: Path, step: int, rank: int, world: int) -> str | None:
    """What is wrong with this rank's share of checkpoint `path` of step `step` (integrity.checked_by), in a few
    words; None if nothing."""
    if path.is_symlink():
        return (f"it is a symbolic link (to {os.readlink(path)}), not a folder of this run's: a checkpoint is read "
                f"only where it was saved")
    try:
        record = read_complete(path)
    except ValueError as e:
        return str(e)
    if record.get("step") != step:
        return f"its {COMPLETE} records step {record.get('step')}, not {step}: a copy of another step's folder?"
    if "files" not in record:
        if rank == 0:
            logger.warning("checkpoint %s has no checksums (saved before they were recorded): resuming it unverified",
                           path)
        return None
    problem = check_files(path, record, rank, world, hash_threads())
    if problem is None and rank == 0:  # COMPLETE is not among the digested files: the state it vouches for must agree
        saved = _saved_step(path)
        if saved != step:
            problem = saved if isinstance(saved, str) else (f"it holds the state of step {saved}, not {step}: a copy "
                                                            "of another step's folder?")
    return problem


def _saved_step(path: Path) -> int | str:
    """The step a checkpoint's train state records (read alone, on this process), or why it cannot be read."""
    state = {"train": b""}
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
        return from_bytes(state["train"], "train", path)["step"]
    except CheckpointError as e:
        return str(e)
    except (Exception, CheckpointException) as e:  # noqa: BLE001  (DCP's wrapper is a BaseException)
        return f"its train state cannot be read ({one_line(first_cause(e))})"


def verified_resume_step(folder: str | Path, load_step: int = -1, group=None) -> int | None:
    """The step to resume, the same on every rank of `group`: `checkpoint.load_step`, or else the newest complete
    checkpoint whose files match COMPLETE's digests, falling back to older ones (each failure logged in one line,
    with the step resumed); None when `folder` holds no complete checkpoint. Complete checkpoints newer than the one
    resumed are moved aside, so that the next launch continues this line, not theirs (`_set_aside`). CheckpointError
    (nothing moved) when `load_step` is not complete or fails verification, or when no checkpoint verifies."""
    folder = Path(folder)
    rank, world = rank_world(group)
    if rank == 0:
        _reportset_aside(folder)
        if misnamed := _misnamed(folder):
            logger.warning("checkpoint: %s in %s %s not named step-<step> (ASCII digits, no leading zero): ignored, "
                           "never resumed, pruned or moved", ", ".join(misnamed), folder,
                           "is" if len(misnamed) == 1 else "are")
    listed = [sorted(_resume_candidates(folder))]
    if dist.is_initialized():  # rank 0's listing, so that every rank walks the same steps
        dist.broadcast_object_list(listed, src=0, group=group)
    complete = {step: folder / f"step-{step}" for step in listed[0]}
    if load_step >= 0 and load_step not in complete:
        shown = ", ".join(f"step-{s}" for s in sorted(complete)) or "none"
        raise CheckpointError(f"checkpoint.load_step = {load_step}: {folder / f'step-{load_step}'} is not a complete "
                              f"checkpoint (complete ones: {shown})", every_rank=True)
    candidates = [load_step] if load_step >= 0 else sorted(complete, reverse=True)
    failed = []
    for step in candidates:
        problem = agreed(_problem(complete[step], step, rank, world), group)
        if problem is None:
            break
        failed.append(f"checkpoint step-{step} failed verification: {problem}")
    else:
        if not candidates:
            return None
        what = (f"pick another checkpoint.load_step (complete ones: {', '.join(f'step-{s}' for s in sorted(complete))})"
                if load_step >= 0 else f"no checkpoint in {folder} verifies: restore one, or start afresh in another "
                                       "job.dump_folder")
        raise CheckpointError("; ".join(failed) + f"; {what}", every_rank=True)
    if rank == 0:
        for line in failed:
            logger.warning("%s; resuming from step-%d", line, step)
    newer = [complete[s] for s in sorted(complete) if s > step]
    if newer:
        why = (f"checkpoint.load_step rolls back to step-{step}" if load_step >= 0 else
               f"newer than step-{step}, the newest that verifies")
        error = None
        if rank == 0:
            try:
                set_aside(folder, newer, why)
            except OSError as e:
                error = f"cannot move {', '.join(p.name for p in newer)} aside in {folder} ({why}): {e}"
        error = agreed(error, group)
        if error is not None:
            raise CheckpointError(error, every_rank=True)
    return step


def _reportset_aside(folder: Path) -> None:
    """One line when earlier launches set checkpoints aside here: nothing deletes them (they may be the line a user
    wants back), so a full disk should not come as a surprise."""
    aside = sorted(folder.glob(f"{ABANDONED}*"))
    if aside:
        size = sum(size_of(path) for path in aside)
        logger.info("checkpoint: %d folder(s) of checkpoints set aside earlier are kept in %s (%s, %.2f GiB): "
                    "delete them once they are not needed", len(aside), folder, ", ".join(p.name for p in aside),
                    size / 1024**3)


def size_of(path: Path) -> int:
    """Bytes of the files under `path` (a link counts as itself: never followed); what cannot be read, as 0."""
    total = 0
    for root, _, files in os.walk(path):  # os.walk skips what it cannot list, and never enters a link
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def gib(size: int) -> str:
    return f"{size / 1024**3:.2f} GiB" if size >= 2**30 else f"{size / 1024**2:.1f} MiB"


def set_aside(folder: Path, paths: list[Path], why: str) -> None:
    """Move step folders (or links) into <folder>/abandoned-<UTC time>/, out of "latest" and out of pruning's reach.
    A folder without write permission cannot change parent (its `..` entry would change): it is renamed in place to
    abandoned-<UTC time>.step-N instead. A rename moves a link itself, never what it points to."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target, n = folder / f"{ABANDONED}{stamp}", 1
    while target.exists():
        target, n = folder / f"{ABANDONED}{stamp}-{n}", n + 1
    target.mkdir()
    moved = []
    try:
        for path in paths:
            try:
                path.rename(target / path.name)
                moved.append(target / path.name)
            except PermissionError:
                path.rename(folder / f"{target.name}.{path.name}")
                moved.append(folder / f"{target.name}.{path.name}")
    finally:
        if not any(target.iterdir()):  # nothing moved into it: no empty abandoned-* left behind
            target.rmdir()
    logger.warning("moved %s aside to %s (%s); pruning never touches them", ", ".join(p.name for p in paths),
                   ", ".join(sorted({str(p.parent if p.parent != folder else p) for p in moved})), why)
