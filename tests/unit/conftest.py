"""Fixtures shared by the unit tests."""

import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


@pytest.fixture
def one_rank_mesh():
    """A one-process gloo group and its 1-D mesh, for the parallel code's collectives without subprocesses."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One token cache for every training run of a test module."""
    return tmp_path_factory.mktemp("dataset_cache")


@pytest.fixture
def deterministic_off_after():
    """For tests whose runs set training.deterministic: a process-wide switch, kept out of later tests."""
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture
def own_logging():
    """harness.train.main sets up logging on pytest's captured stderr: put back what was there, so that tests run
    after these do not log to a closed stream."""
    root, ours = logging.getLogger(), [logging.getLogger(name) for name in ("harness", "models", "parallel")]
    handlers, levels = root.handlers[:], [root.level] + [logger.level for logger in ours]
    yield
    root.handlers[:] = handlers
    for logger, level in zip([root, *ours], levels):
        logger.setLevel(level)
