"""Full activation checkpointing of compiled blocks under FSDP (2 gloo ranks, fp32): the MoE halves that dynamo
traces with their checkpoint and the one it cannot (FSDP's hooks inside: the first block's experts are a unit of
their own) give the eager, uncheckpointed model's loss and gradients (compiled_checkpoint_worker.py)."""

import pytest
import torch

from tests.builders import fp32_grad_tolerance
from tests.distributed.launch import Run, register

COMPARE = register(Run("compiled_checkpointing/compare", 2, "tests.distributed.compiled_checkpoint_worker:compare"))


def test_compiled_full_checkpointing_under_fsdp_matches_eager(launches):
    record = torch.load(launches.folder_of(COMPARE) / "result.pt")
    eager, full = record["eager"], record["full"]
    assert full["traced"] == [False, True]  # the first block (FSDP's experts unit inside), the second
    assert full["loss"].item() == pytest.approx(eager["loss"].item(), rel=1e-6)
    for name, grad in eager["grads"].items():
        tol = fp32_grad_tolerance(name)
        torch.testing.assert_close(full["grads"][name], grad, rtol=tol, atol=tol * 1e-2, msg=name)
