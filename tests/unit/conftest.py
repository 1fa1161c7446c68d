"""Fixtures shared by the unit tests."""

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


@pytest.fixture
def one_rank_mesh():
    """A one-process gloo group and its 1-D mesh, for the parallel code's collectives without subprocesses."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()
