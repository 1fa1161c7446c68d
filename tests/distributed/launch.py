"""The distributed tests' shared launches: torchrun on this machine, the repository on the path, one thread a rank.

A test module registers its runs (`register`: a name, a number of processes and a function of a
tests/distributed/*_worker.py), and reads their results through the session's `launches` fixture (tests/conftest.py).
There is one launch per number of processes, which runs every run registered for it one after the other in the same
processes (runs_worker.py): starting torch in 2 or 4 processes costs more than most runs. Runs that read other runs'
outputs (a checkpoint to resume) wait for a later launch: one per stage and number of processes.

The launches start in a background thread when the session starts, in stage order, while the tests that need none
(tests/unit) run; a test asking for a run waits for its launch. A launch started before a test asks for it cannot
know which runs the test will ask for: each launch runs every registered run of its stage and size."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNS_WORKER = str(REPO / "tests" / "distributed" / "runs_worker.py")
FINISHED, FAILED = "finished", "failed.{}.txt"  # what a run leaves in its folder (failed.rank0.txt: its traceback)
SKIPPED = "skipped.txt"  # a run that did not start: a run it reads failed
TIMEOUT = 600  # a rank left waiting at a collective would hang for gloo's timeout: this turns that into a failure


@dataclass(frozen=True)
class Run:
    """One run of a shared launch: `target` ("module:function") is called as function(folder, *args) in each of
    `nproc` processes (a plain process for 1, torchrun's ranks over gloo otherwise), `folder` being this run's own
    ("{folder}" in an argument stands for it). A run that reads the outputs of others names them in `after`: it
    runs in a launch after theirs. `prepare(folder, *folders of after)`, if given, writes the run's inputs into its
    folder before its launch starts; it runs in the background thread, beside other tests, so it may write files
    and start processes but must leave torch alone (its default dtype, seeds and compiled code are the tests').
    A run of 0 processes is its `prepare` alone (`started_processes`)."""
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


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
            "--rdzv-endpoint=localhost:0"]


class SharedLaunches:
    """The registered runs' results: one launch per stage and number of processes, started in the background
    (`start`) or when a test first asks for one of its runs."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.outputs: dict[tuple[int, int], str] = {}  # what each finished launch printed
        self.lock = threading.RLock()  # one launch at a time: each takes the host's cores
        self.running: subprocess.Popen | None = None
        self.closed = False

    def start(self) -> None:
        """Launches every registered run, stage by stage, in a background thread."""
        keys = sorted({(run.stage, run.nproc) for run in REGISTERED.values()})
        threading.Thread(target=lambda: [self._launched(key) for key in keys], daemon=True).start()

    def close(self) -> None:
        """Stops the launch in progress, if any (the session ends)."""
        self.closed = True
        if self.running is not None and self.running.poll() is None:
            os.killpg(self.running.pid, signal.SIGKILL)

    def folder_of(self, run: Run) -> Path:
        """`run`'s folder once it has finished; fails the calling test with the run's error if it raised, or with
        the launch's output if it never finished (a run before it in the same launch failed or hung), or with why
        it did not run (a run it reads failed)."""
        problem = self._problem(run)
        if problem is not None:
            pytest.fail(problem, pytrace=False)
        return self.folder / run.name

    def _problem(self, run: Run) -> str | None:
        output = self._launched((run.stage, run.nproc))
        folder = self.folder / run.name
        if (folder / SKIPPED).exists():
            return (folder / SKIPPED).read_text()
        errors = sorted(folder.glob(FAILED.format("*")))
        if errors:
            return f"run {run.name} raised:\n" + "\n".join(dict.fromkeys(e.read_text() for e in errors))  # once
        if not (folder / FINISHED).exists():
            failed = [r.name for r in REGISTERED.values() if (r.stage, r.nproc) == (run.stage, run.nproc)
                      and any((self.folder / r.name).glob(FAILED.format("*")))]
            if failed:
                return f"run {run.name} did not run: {failed[0]}, before it in its launch, raised (its test says why)"
            # The ranks' exceptions come before torchrun's summary, which alone would fill the tail.
            causes = "\n".join([line for line in output.splitlines() if "Error" in line or "error:" in line][:10])
            return f"run {run.name} did not finish; its launch printed:\n{causes}\n...\n{output[-5000:]}"
        return None

    def _launched(self, key: tuple[int, int]) -> str:
        """The output of the launch of `key` (stage, processes), which this call runs if no call has yet."""
        with self.lock:
            if key not in self.outputs:
                self.outputs[key] = self._launch(key)
            return self.outputs[key]

    def _launch(self, key: tuple[int, int]) -> str:
        if self.closed:
            return "the session ended first"
        ready = []
        for run in (r for r in REGISTERED.values() if (r.stage, r.nproc) == key):
            folder = self.folder / run.name
            folder.mkdir(parents=True, exist_ok=True)
            problems = [p for p in map(self._problem, run.after) if p is not None]
            if problems:
                (folder / SKIPPED).write_text(f"run {run.name} did not run: it reads another run, and " + problems[0])
                continue
            try:
                if run.prepare is not None:
                    run.prepare(folder, *(self.folder / r.name for r in run.after))
            except Exception:  # noqa: BLE001  (reported by the test that reads the run)
                (folder / FAILED.format("prepare")).write_text(traceback.format_exc())
                continue
            if key[1] == 0:
                (folder / FINISHED).touch()
            else:
                ready.append(run)
        if not ready:
            return ""
        spec = self.folder / "launch{}-{}.json".format(*key)
        spec.write_text(json.dumps([[str(self.folder / r.name), r.target,
                                     *(a.replace("{folder}", str(self.folder / r.name)) for a in r.args)]
                                    for r in ready]))
        nproc = key[1]
        cmd = [*(torchrun(nproc) if nproc > 1 else [sys.executable]), RUNS_WORKER, str(spec)]
        # Inductor compiles in the runs' own processes: one CI run under load aborted a rank with "terminate called
        # without an active exception"; inductor's pool of compile workers is a suspect, not proven.
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        self.running = subprocess.Popen(cmd, cwd=self.folder, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = self.running.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(self.running.pid, signal.SIGKILL)
            output = self.running.communicate()[0] + f"\nkilled after {TIMEOUT} s"
        spec.with_suffix(".log").write_text(output)  # with each run's time
        return output
