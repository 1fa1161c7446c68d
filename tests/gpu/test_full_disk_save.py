"""A checkpoint of CUDA tensors meeting a full disk: the same one-line CheckpointError (exit 2) as on CPU, the folder
left without COMPLETE. DCP copies CUDA tensors to the host through its overlapping loader and writes them with
torch.save's C++ writer, which reports the failed write as its own RuntimeError; under a process group (every GPU run
has one) DCP passes it to all ranks through a pickle, which drops the OSError behind it. Seen on an H200 with a full
tmpfs as a traceback and exit 1 before the checkpointer took that RuntimeError for a refused write."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import harness.checkpoint.checkpointer as checkpointer
from harness.checkpoint.checkpointer import COMPLETE, Checkpointer
from harness.checkpoint.errors import CheckpointError
from tests.checkpoint_faults import disk_fills_during_dcp_writes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class _Rows:
    """A data loader's position, as Checkpointer saves it."""

    def state_dict(self) -> dict:
        return {"next_row": 0}


@pytest.fixture
def one_nccl_rank():
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda:0"))
    yield
    dist.destroy_process_group()


def test_a_full_disk_during_a_save_of_cuda_tensors_is_one_checkpoint_error(tmp_path, monkeypatch, one_nccl_rank):
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 1024, device="cuda")).sum().backward()
    optimizer.step()
    saver = Checkpointer(tmp_path, model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1), _Rows(),
                         keep_latest_k=2, async_mode="disabled", model_config={})
    disk_fills_during_dcp_writes(monkeypatch, under="step-1")  # inside the first tensor's bytes
    full = type("Usage", (), {"total": 1 << 30, "used": 1 << 30, "free": 0})
    monkeypatch.setattr(checkpointer.shutil, "disk_usage", lambda path: full)
    with pytest.raises(CheckpointError, match=r"cannot save checkpoint step-1 to .*: No space left on device "
                                              r"\(torch's writer: unexpected pos"):
        saver.save(1)
    assert (tmp_path / "step-1").is_dir() and not (tmp_path / "step-1" / COMPLETE).exists()
