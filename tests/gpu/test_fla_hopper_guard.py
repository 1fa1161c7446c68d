"""What the FLA Hopper bypass relies on inside FLA (models/qwen35_moe/kernels/fla_hopper_guard.py): FLA's gated
backward reads the flag `TRITON_ABOVE_3_7_1` of its module fla.ops.common.chunk_o at each call, refuses on Hopper
while it is False and runs once it is set. Checked on the installed FLA whatever the GPU and Triton: the guard's
other inputs are given the values that make it fire (a Hopper GPU, Triton >= 3.4). It fails when an FLA release
moves or renames the flag, reads it elsewhere or stops honouring it: the bypass would then do nothing, and runs
that rely on it would stop at their first backward."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

from models.qwen35_moe.kernels.fla_hopper_guard import GUARD_MODULE
from models.qwen35_moe.kernels.gated_delta_rule import gated_delta_rule
from tests.gpu.test_fla_kernels import CU_SEQLENS, DV, HV, gdn_inputs

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="FLA kernels need a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("tilelang") is not None,
                                 reason="with tilelang installed FLA takes its TileLang backward: no guard")]


def _backward():
    inputs = [x.requires_grad_() for x in gdn_inputs(1, CU_SEQLENS[-1], torch.bfloat16)]
    o = gated_delta_rule(*inputs, cu_seqlens=torch.tensor(CU_SEQLENS, device="cuda"))
    return torch.autograd.grad(o, inputs, torch.randn(1, CU_SEQLENS[-1], HV, DV, device="cuda", dtype=o.dtype))


def test_flas_hopper_guard_refuses_until_the_flag_the_bypass_sets_is_set(monkeypatch):
    chunk_o = importlib.import_module(GUARD_MODULE)
    # The machine the guard fires on. The flag itself must exist: setting a missing one fails the test.
    monkeypatch.setattr(chunk_o, "IS_NVIDIA_HOPPER", True, raising=False)
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_4_0", True, raising=False)
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_7_1", False)
    with pytest.raises(Exception):  # noqa: B017 - FLA's refusal, whatever its type and wording
        _backward()
    monkeypatch.setattr(chunk_o, "TRITON_ABOVE_3_7_1", True)
    grads = _backward()
    assert all(torch.isfinite(g).all() for g in grads)
