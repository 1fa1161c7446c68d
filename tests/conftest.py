"""Session-wide setup: the order of the folders, and the distributed tests' shared launches
(tests/distributed/launch.py), started in the background at the session's start."""

import pytest

from tests.distributed.launch import SharedLaunches

ORDER = ("unit", "distributed", "gpu")  # the distributed tests last but the GPU's: their launches have had time


def pytest_collection_modifyitems(config, items):
    def folder(item):
        parts = item.path.relative_to(config.rootpath).parts  # ("tests", "unit", "test_x.py")
        return ORDER.index(parts[1]) if len(parts) > 2 and parts[1] in ORDER else len(ORDER)

    items.sort(key=folder)  # stable: each folder keeps its own order


@pytest.fixture(scope="session")
def launches(tmp_path_factory) -> SharedLaunches:
    """The registered runs (tests/distributed/launch.py), one launch per stage and number of processes."""
    shared = SharedLaunches(tmp_path_factory.mktemp("launches"))
    yield shared
    shared.close()


@pytest.fixture(scope="session", autouse=True)
def launches_in_background(request):
    """Starts the shared launches when the session starts, if a selected test reads them."""
    if any("launches" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("launches").start()
