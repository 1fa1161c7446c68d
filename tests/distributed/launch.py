"""The distributed tests' shared launches: ranks forked from one process (runs_worker.py), the repository on the path,
one thread a rank.

A test module registers its runs (`register`: a name, a number of processes and a function of a
tests/distributed/*_worker.py), and reads their results through the session's `launches` fixture (tests/conftest.py).
There is one launch per number of processes, which runs every run registered for it one after the other in the same
processes (runs_worker.py): starting torch in 2 or 4 processes costs more than most runs. Runs that read other runs'
outputs (a checkpoint to resume) wait for a later launch: one per stage and number of processes.

The launches start in a background thread when the session starts, in stage order, while the tests that need none
(tests/unit) run; a test asking for a run waits for its launch. A launch started before a test asks for it cannot
know which runs the test will ask for: each launch runs every registered run of its stage and size.

A run that fails (raises, or its launch ends while it runs: a rank killed, a connection broken) ends its launch: a rank
could be left waiting in a collective the failed one will never join. The runs after it then run in another launch,
and the failed run once more, after them: its test fails if it fails again, naming both errors, the first first, and
passes with a warning naming the first error if not. No other test sees the failure."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNS_WORKER = str(REPO / "tests" / "distributed" / "runs_worker.py")
# What a run leaves in its folder: `started` when it begins, `finished` once every rank has returned from it, or
# failed.rank0.txt (its traceback on rank 0) and the like; skipped.txt if it did not start (a run it reads failed).
STARTED, FINISHED, FAILED, SKIPPED = "started", "finished", "failed.{}.txt", "skipped.txt"
OWNER, LAUNCHED = "owner.pid", "launched-{}-{}.txt"  # the launching test process; a key's output, once done
FIRST_ATTEMPT = "{}.first-attempt"  # a failed run's folder, set aside when it runs again
# Hang guards, not time limits: the longest run takes 30 s on an idle 2-core machine, a few minutes under heavy load.
COLLECTIVE_TIMEOUT_S = 900  # how long a rank waits at a collective (gloo's timeout: the waiting rank then raises)
HANG_S = 1800  # a launch in which no run starts or finishes for this long is stopped; its run in progress fails
POLL_S = 10  # how often a launch's progress is looked at


@dataclass(frozen=True)
class Run:
    """One run of a shared launch: `target` ("module:function") is called as function(folder, *args) in each of
    `nproc` processes (a plain process for 1, ranks over gloo otherwise), `folder` being this run's own
    ("{folder}" in an argument stands for it). A run that reads the outputs of others names them in `after`: it
    runs in a launch after theirs. `prepare(folder, *folders of after)`, if given, writes the run's inputs into its
    folder before its launch starts (again, into a new folder, if the run fails and runs again); it runs in the
    background thread, beside other tests, so it may write files and start processes but must leave torch alone
    (its default dtype, seeds and compiled code are the tests'). A run of 0 processes is its `prepare` alone
    (`started_processes`)."""
    name: str
    nproc: int
    target: str = ""
    args: tuple[str, ...] = ()
    prepare: Callable[..., None] | None = None
    after: tuple[Run, ...] = ()

    @property
    def stage(self) -> int:
        return 1 + max(r.stage for r in self.after) if self.after else 0


REGISTERED: dict[str, Run] = {}


def register(run: Run) -> Run:
    """Adds `run` to the shared launch of its stage and number of processes (test modules register theirs when
    imported, so every run is known before the first launch starts)."""
    assert REGISTERED.setdefault(run.name, run) == run, f"two runs named {run.name}"
    return run


def register_first(*runs: Run) -> tuple[Run, ...]:
    """Registers `runs`, in this order, ahead of the runs registered before them: first in their launches."""
    for run in runs:
        register(run)
    ordered = {run.name: run for run in runs} | {name: run for name, run in REGISTERED.items() if run not in runs}
    REGISTERED.clear()
    REGISTERED.update(ordered)
    return runs


def register_layouts(prefix: str, target: str, layouts: dict[str, tuple[int, tuple[str, ...]]]) -> tuple[Run, dict]:
    """`target` run on one process ("<prefix>/single") and once per layout, {name: (processes, its flags)}: the
    one-process reference and {name: run}."""
    single = register(Run(f"{prefix}/single", 1, target))
    return single, {name: register(Run(f"{prefix}/{name}", nproc, target, flags))
                    for name, (nproc, flags) in layouts.items()}


def started_processes(name: str, start: Callable[[Path], None]) -> Run:
    """A registered run that starts processes of its own (`start(folder)`: run_train.sh as a user runs it, say,
    leaving what they printed in `folder`), in the background with the launches."""
    return register(Run(name, 0, prepare=start))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a rendezvous the processes started next will open)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def errors_in(folder: Path) -> str:
    """The errors a run left in `folder` (each rank's traceback, or why its launch ended), each once."""
    return "\n".join(dict.fromkeys(e.read_text() for e in sorted(folder.glob(FAILED.format("*")))))


def causes(output: str) -> str:
    """What a launch printed, for a failure: its error lines first (the ranks' exceptions come before the launcher's
    summary, which alone would fill the tail), then its tail."""
    errors = "\n".join([line for line in output.splitlines() if "Error" in line or "error:" in line][:10])
    return f"{errors}\n...\n{output[-5000:]}"


class RanAgain(UserWarning):
    """A run failed in its first launch and passed in a later one."""


class SharedLaunches:
    """The registered runs' results: one launch per stage and number of processes, started in the background
    (`start`) or when a test first asks for one of its runs; after a failure, the rest in another.

    Under pytest-xdist the test processes share one folder: the first to claim it (`claim`) launches, the others
    (`owner` False) read each launch's output from the file it leaves there once its runs are done."""

    def __init__(self, folder: Path, runs: dict[str, Run] | None = None, owner: bool = True):
        self.folder = folder
        self.runs = REGISTERED if runs is None else runs
        self.owner = owner
        self.outputs: dict[tuple[int, int], str] = {}  # what the launches of each key printed
        self.lock = threading.RLock()  # one launch at a time: each takes the host's cores
        self.running: subprocess.Popen | None = None
        self.thread: threading.Thread | None = None
        self.closed = False

    @staticmethod
    def claim(folder: Path) -> bool:
        """True for the first test process to claim `folder` (it then launches the runs for all of them)."""
        folder.mkdir(parents=True, exist_ok=True)
        mine = folder / f"{OWNER}.{os.getpid()}"
        mine.write_text(str(os.getpid()))
        try:
            os.link(mine, folder / OWNER)  # atomic, and the file already holds the pid when others read it
        except FileExistsError:
            return False
        finally:
            mine.unlink()
        return True

    def start(self) -> None:
        """Launches every registered run, stage by stage, in a background thread (the owner's only)."""
        if not self.owner or self.thread is not None:
            return
        keys = sorted({(run.stage, run.nproc) for run in self.runs.values()})
        self.thread = threading.Thread(target=lambda: [self._launched(key) for key in keys], daemon=True)
        self.thread.start()

    def close(self, wait: bool = False) -> None:
        """Stops the launch in progress, if any (the session ends); with `wait`, lets the background launches end
        first (other test processes may still read them)."""
        if wait and self.thread is not None:
            self.thread.join()
        self.closed = True
        if self.running is not None and self.running.poll() is None:
            os.killpg(self.running.pid, signal.SIGKILL)

    def folder_of(self, run: Run) -> Path:
        """`run`'s folder once it has finished; fails the calling test with `problem` if it has not, and warns with
        the first error of a run that passed when it ran again."""
        problem = self.problem(run)
        if problem is not None:
            pytest.fail(problem, pytrace=False)
        first = self.first_error(run)
        if first:
            warnings.warn(f"run {run.name} failed in its first launch and passed in another:\n{first}", RanAgain,
                          stacklevel=2)
        return self.folder / run.name

    def problem(self, run: Run) -> str | None:
        """None once `run` has finished; otherwise its error (both, if it failed twice), or why it did not run (a
        run it reads failed, or the session ended first)."""
        output = self._launched((run.stage, run.nproc))
        folder = self.folder / run.name
        if (folder / SKIPPED).exists():
            return (folder / SKIPPED).read_text()
        if (folder / FINISHED).exists():
            return None
        errors, first = errors_in(folder), self.first_error(run)
        if first and errors:
            return f"run {run.name} failed twice, in two launches. The first time:\n{first}\nThe second time:\n{errors}"
        if first:
            return f"run {run.name} failed in its first launch and did not run again (the session ended?):\n{first}"
        if errors:
            return f"run {run.name} failed:\n{errors}"
        return f"run {run.name} did not run; its launches printed:\n{causes(output)}"

    def first_error(self, run: Run) -> str:
        """The error of `run`'s first launch if it failed there and ran again, else ""."""
        return errors_in(self.folder / FIRST_ATTEMPT.format(run.name))

    def _launched(self, key: tuple[int, int]) -> str:
        """The output of the launches of `key` (stage, processes), which this call runs if no call has yet (or, in a
        process that does not own the folder, waits for the owner's)."""
        if not self.owner:
            return self._read_launched(key)
        with self.lock:
            if key not in self.outputs:
                self.outputs[key] = self._launch(key)
                (self.folder / LAUNCHED.format(*key)).write_text(self.outputs[key])
            return self.outputs[key]

    def _read_launched(self, key: tuple[int, int]) -> str:
        """The output the owner left for `key`, once it is there; why not, if the owner ended first."""
        done, owner = self.folder / LAUNCHED.format(*key), int((self.folder / OWNER).read_text())
        while not done.exists():
            try:
                os.kill(owner, 0)
            except ProcessLookupError:
                if not done.exists():
                    return f"the test process that launched the runs (pid {owner}) ended first"
            time.sleep(0.5)
        return done.read_text()

    def _launch(self, key: tuple[int, int]) -> str:
        """Runs the runs of `key` in one launch, or, after a failure, the runs after the failed one in another and the
        failed run again, after them. A launch that fails before its first run is launched again, once."""
        if self.closed:
            return "the session ended first"
        failed_once: set[str] = set()
        ready = self._prepared([r for r in self.runs.values() if (r.stage, r.nproc) == key], failed_once)
        outputs: list[str] = []
        unstarted = 0  # launches that failed before their first run
        while ready and not self.closed:
            output, hung = self._run(key, ready, len(outputs) + 1)
            outputs.append(output)
            waiting = [r for r in ready if not (self.folder / r.name / STARTED).exists()]
            if len(waiting) == len(ready):
                unstarted += 1
                if unstarted == 1:
                    continue
                for run in ready:
                    (self.folder / run.name / FAILED.format("launch")).write_text(
                        f"run {run.name} did not start: its launch failed before its first run, twice:\n"
                        f"{causes(output)}\n")
                break
            failed = []
            for run in ready:
                folder = self.folder / run.name
                if run in waiting or (folder / FINISHED).exists():
                    continue
                if not errors_in(folder):  # its launch ended while it ran
                    why = (f"it ran for over {HANG_S} s (a hang?); its launch was stopped" if hung else
                           f"its launch ended while it ran (a rank killed or lost?):\n{causes(output)}")
                    (folder / FAILED.format("launch")).write_text(f"run {run.name}: {why}\n")
                if not hung and self._set_aside(run, failed_once):
                    failed.append(run)
            ready = waiting + self._prepared(failed, failed_once)
        return "\n".join(outputs)

    def _set_aside(self, run: Run, failed_once: set[str]) -> bool:
        """After `run` failed: True, its folder set aside, if it was its first failure."""
        if run.name in failed_once:
            return False
        failed_once.add(run.name)
        (self.folder / run.name).rename(self.folder / FIRST_ATTEMPT.format(run.name))
        return True

    def _prepared(self, runs: list[Run], failed_once: set[str]) -> list[Run]:
        """`runs` prepared for a launch, in order, without those that do not run (a run they read failed), have
        finished (a run of 0 processes) or whose `prepare` raised twice."""
        ready = []
        for run in runs:
            prepared = self._prepare(run)
            if not prepared and errors_in(self.folder / run.name) and self._set_aside(run, failed_once):
                prepared = self._prepare(run)
            if prepared:
                ready.append(run)
        return ready

    def _prepare(self, run: Run) -> bool:
        """Writes `run`'s inputs; True if it is ready for its launch."""
        folder = self.folder / run.name
        folder.mkdir(parents=True, exist_ok=True)
        problems = [p for p in map(self.problem, run.after) if p is not None]
        if problems:
            (folder / SKIPPED).write_text(f"run {run.name} did not run: it reads another run, and " + problems[0])
            return False
        try:
            if run.prepare is not None:
                run.prepare(folder, *(self.folder / r.name for r in run.after))
        except Exception:  # noqa: BLE001  (reported by the test that reads the run)
            (folder / FAILED.format("prepare")).write_text(traceback.format_exc())
            return False
        if run.nproc == 0:
            (folder / FINISHED).touch()
            return False
        return True

    def _run(self, key: tuple[int, int], runs: list[Run], number: int) -> tuple[str, bool]:
        """Launch `number` of `key`: `runs` in one process or on forked ranks. Returns what it printed and whether it
        was stopped as hung."""
        spec = self.folder / "launch{}-{}-{}.json".format(*key, number)
        spec.write_text(json.dumps([[str(self.folder / r.name), r.target,
                                     *(a.replace("{folder}", str(self.folder / r.name)) for a in r.args)]
                                    for r in runs]))
        nproc = key[1]
        cmd = [sys.executable, RUNS_WORKER, str(nproc), str(spec)]
        # Inductor compiles in the runs' own processes: one CI run under load aborted a rank with "terminate called
        # without an active exception"; inductor's pool of compile workers is a suspect, not proven.
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        log = spec.with_suffix(".log")  # with each run's time and CPU time
        with open(log, "w") as out:
            self.running = subprocess.Popen(cmd, cwd=self.folder, env=env, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
            hung = self._hung(runs)
        return log.read_text(), hung

    def _hung(self, runs: list[Run]) -> bool:
        """Waits for the launch of `runs` to end; stops it and returns True if none of them starts or finishes for
        HANG_S seconds."""
        launch, ended = self.running, threading.Event()
        threading.Thread(target=lambda: (launch.wait(), ended.set()), daemon=True).start()  # a blocking wait: no polls
        marks, last = -1, time.monotonic()
        while not ended.wait(POLL_S):
            now = sum((self.folder / r.name / mark).exists() for r in runs for mark in (STARTED, FINISHED))
            if now != marks:
                marks, last = now, time.monotonic()
            elif time.monotonic() - last > HANG_S:
                os.killpg(launch.pid, signal.SIGKILL)
                ended.wait()
                return True
        return False
