"""Session-wide setup: one intra-op thread, the order of the folders, and the distributed tests' shared launches
(tests/distributed/launch.py), started in the background at the session's start."""

import gc
import os
import sys

import pytest

# One thread in every test process, as the distributed tests' ranks and run_train.sh's tests have always had: the
# shared launches run beside the other tests, on the same cores, where a second intra-op thread only waits for a
# core (the whole suite took 10-15% longer with two on 2 cores). torch reads this once, when it loads.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.distributed.launch import SharedLaunches  # noqa: E402  (after the thread setting: it imports no torch)

# The distributed tests last but the GPU's: their launches have had time. The benchmarks/ scripts' tests, one process
# each like the unit tests, run beside the launches too.
ORDER = ("unit", "benchmarks", "distributed", "gpu")


def pytest_collection_modifyitems(config, items):
    def folder(item):
        parts = item.path.relative_to(config.rootpath).parts  # ("tests", "unit", "test_x.py")
        return ORDER.index(parts[1]) if len(parts) > 2 and parts[1] in ORDER else len(ORDER)

    items.sort(key=folder)  # stable: each folder keeps its own order


def pytest_collection_finish(session):
    """The objects the imports and the collection made (~300k: torch, transformers, the test modules) are left out of
    the cyclic collector's later passes: a full collection scans them all, ~0.2 s of CPU, and the trainer's error
    paths and Python's own schedule run many in a session."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(optionalhook=True)  # xdist's hook: without the plugin (-p no:xdist) pytest must not reject it
def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one test process per core, at most 4 (the shared launches' ranks want cores too)."""
    # the cores this process may use; macOS has no affinity call
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores))


@pytest.fixture(scope="session")
def launches(tmp_path_factory) -> SharedLaunches:
    """The registered runs (tests/distributed/launch.py), one launch per stage and number of processes. Under
    pytest-xdist one test process launches them, in a folder beside every process's own, and the others read it."""
    under_xdist = os.environ.get("PYTEST_XDIST_WORKER") is not None
    if under_xdist:
        folder = tmp_path_factory.getbasetemp().parent / "launches"
        shared = SharedLaunches(folder, owner=SharedLaunches.claim(folder))
    else:
        shared = SharedLaunches(tmp_path_factory.mktemp("launches"))
    yield shared
    shared.close(wait=under_xdist)  # the other test processes may still read the owner's launches


@pytest.fixture(scope="session", autouse=True)
def launches_in_background(request):
    """Starts the shared launches when the session starts, if a selected test reads them."""
    if any("launches" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("launches").start()
