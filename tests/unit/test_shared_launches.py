"""Under pytest-xdist the shared launches (tests/distributed/launch.py) run once: the first test process to claim
their folder launches them, the others wait for the output each launch leaves there, and learn of an owner that
ended without leaving it instead of waiting for ever."""

import subprocess
import sys
import threading

from tests.distributed.launch import OWNER, Run, SharedLaunches


def _writes_its_mark(folder, calls):
    calls.append(folder.name)
    (folder / "mark").write_text("made once")


def test_one_process_launches_and_another_reads_its_results(tmp_path):
    calls = []
    run = Run("shared/mark", 0, prepare=lambda folder: _writes_its_mark(folder, calls))
    folder = tmp_path / "launches"
    assert SharedLaunches.claim(folder) and not SharedLaunches.claim(folder)
    owner = SharedLaunches(folder, {run.name: run}, owner=True)
    reader = SharedLaunches(folder, {run.name: run}, owner=False)
    answers = []
    waiting = threading.Thread(target=lambda: answers.append(reader.problem(run)))
    waiting.start()  # waits: nothing launched yet
    waiting.join(1.0)
    assert waiting.is_alive() and not answers
    owner.start()
    waiting.join(30)
    owner.close(wait=True)
    assert answers == [None] and calls == ["mark"]  # the run made once, by the owner
    assert (reader.folder_of(run) / "mark").read_text() == "made once"


def test_a_reader_whose_owner_ended_first_is_told_so(tmp_path):
    run = Run("shared/never", 0, prepare=lambda folder: None)
    folder = tmp_path / "launches"
    folder.mkdir()
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (folder / OWNER).write_text(ended.stdout.strip())  # a process id no process holds any more
    problem = SharedLaunches(folder, {run.name: run}, owner=False).problem(run)
    assert problem.startswith("run shared/never did not run") and "ended first" in problem
