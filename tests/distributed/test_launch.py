"""The shared launches (tests/distributed/launch.py) contain a failure: a run that fails, in a launch of 2 ranks or of
one process, fails its own test alone. The runs after it in its launch run in another launch, and it runs once more
after them: failing again, its test names both errors; passing, its test passes and warns with the first error.

The runs here fail by design (tests/distributed/launch_worker.py), in the launches every other distributed test reads:
each of those passing shows the failure contained. They are first in their launches, so that the launch a failure
ends has run nothing else, and every other run of it runs in the next."""

import json

import pytest

from tests.distributed.launch import FIRST_ATTEMPT, RanAgain, Run, register_first

WORKER = "tests.distributed.launch_worker"
FAILS_ON_RANK_1, AFTER_THE_FAILURE = register_first(Run("launch/fails_on_rank_1", 2, f"{WORKER}:fails_on_rank_1"),
                                                    Run("launch/after_the_failure", 2, f"{WORKER}:sums_over_the_ranks"))
FAILS_ONCE, AFTER_FAILS_ONCE = register_first(Run("launch/fails_once", 1, f"{WORKER}:fails_once"),
                                              Run("launch/after_fails_once", 1, f"{WORKER}:fails_never"))


def test_a_run_that_fails_twice_fails_alone_naming_its_first_error_then_its_second(launches):
    problem = launches.problem(FAILS_ON_RANK_1)
    assert problem.startswith("run launch/fails_on_rank_1 failed twice, in two launches. The first time:\n")
    first, second = problem.split("\nThe second time:\n")
    # The first time rank 1 left without a traceback, and the launcher stopped rank 0: the launch ended during the run.
    assert "run launch/fails_on_rank_1: its launch ended while it ran" in first
    assert "RuntimeError: rank 1 fails this run by design" in second and "RuntimeError" not in first


def test_the_runs_after_a_failed_one_run_in_another_launch_before_it_runs_again(launches):
    folder = launches.folder_of(AFTER_THE_FAILURE)
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["sum"] for r in ranks] == [2.0, 2.0]  # a working process group of both ranks
    first_launch = launches.folder / FIRST_ATTEMPT.format(FAILS_ON_RANK_1.name) / "pid.rank0"
    second_launch = launches.folder / FAILS_ON_RANK_1.name / "pid.rank0"
    assert int(first_launch.read_text()) != ranks[0]["pid"] == int(second_launch.read_text())


def test_a_run_that_passes_when_it_runs_again_passes_warning_with_its_first_error(launches):
    with pytest.warns(RanAgain, match="run launch/fails_once failed in its first launch and passed in another:\n"
                                      "(.|\n)*RuntimeError: this run fails the first time by design"):
        folder = launches.folder_of(FAILS_ONCE)
    assert (folder / "passed").is_file()
    assert (launches.folder_of(AFTER_FAILS_ONCE) / "passed").is_file()
