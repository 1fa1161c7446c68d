"""The self-check behind the FLA Hopper bypass must reject the defects it guards against, on CPU too.

The kernel under check is our torch chunked kernel fed bf16 inputs (fp32 math, bf16 outputs): a correct
kernel at bf16 precision, like FLA's. The defects are injected into its gradients."""

import sys
import types

import pytest
import torch

import models.qwen35_moe.kernels.fla_hopper_guard as guard
import models.qwen35_moe.kernels.gated_delta_rule as gdr
from models.qwen35_moe.kernels.fla_hopper_guard import (
    enable_fla_hopper_backward,
    fla_check_failures,
    fla_gated_delta_rule_errors,
    refuse_fla_hopper_backward,
)
from models.qwen35_moe.kernels.gated_delta_rule import FlaKernelsUnavailableError, torch_chunk_gated_delta_rule
from tests.fault_injection import kernel_with_wrong_dg

SHAPE = (2, 4, 32, 32)  # Hk, Hv, Dk, Dv: small, so the float64 reference is quick on CPU


def correct_kernel(q, k, v, g, beta, cu_seqlens=None):
    return torch_chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens)


class _ZeroBlock(torch.autograd.Function):
    """Identity forward; backward zeroes the gradient of tokens 64..127 of head 2 (a wrong tile)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad[:, 64:128, 2] = 0
        return grad


def kernel_with_wrong_dbeta_tile(q, k, v, g, beta, cu_seqlens=None):
    return correct_kernel(q, k, v, g, _ZeroBlock.apply(beta), cu_seqlens=cu_seqlens)


def test_correct_bf16_kernel_passes():
    errors, biases = fla_gated_delta_rule_errors(*SHAPE, "cpu", kernel=correct_kernel)
    assert fla_check_failures(errors, biases) == []
    assert max(errors.values()) < 5e-3  # bf16 output rounding: at most 2^-8 of a head's largest element


@pytest.mark.parametrize("head", [0, 3])
def test_dg_off_by_one_percent_in_one_head_is_rejected(head):
    errors, biases = fla_gated_delta_rule_errors(*SHAPE, "cpu", kernel=kernel_with_wrong_dg(head, 1.01, correct_kernel))
    assert fla_check_failures(errors, biases) == ["dg bias 1.0e-02"]


def test_a_wrong_tile_of_dbeta_is_rejected():
    errors, biases = fla_gated_delta_rule_errors(*SHAPE, "cpu", kernel=kernel_with_wrong_dbeta_tile)
    failures = fla_check_failures(errors, biases)
    assert any(f.startswith("dbeta error") for f in failures), failures


@pytest.fixture
def hopper_with_old_triton(monkeypatch):
    """Pretend FLA's guard fires: a stand-in for the FLA module whose flag the bypass flips."""
    chunk_o = types.SimpleNamespace(TRITON_ABOVE_3_7_1=False)
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_o", chunk_o)
    monkeypatch.setattr(guard, "fla_hopper_guard_fires", lambda: True)
    monkeypatch.setattr(guard, "_PASSED_CHECKS", {})
    return chunk_o


def test_auto_bypasses_the_guard_only_after_the_check_passes(hopper_with_old_triton):
    with pytest.raises(FlaKernelsUnavailableError, match=r"dg bias 1\.0e-02.*install Triton >= 3\.7\.1"):
        enable_fla_hopper_backward(*SHAPE, "cpu", kernel=kernel_with_wrong_dg(1, 1.01, correct_kernel))
    assert hopper_with_old_triton.TRITON_ABOVE_3_7_1 is False  # guard left in place
    result = enable_fla_hopper_backward(*SHAPE, "cpu", kernel=correct_kernel)
    assert result["needed"] and result["dg_bias"] < 1e-3
    assert hopper_with_old_triton.TRITON_ABOVE_3_7_1 is True


def test_off_refuses_at_once_where_the_guard_fires(hopper_with_old_triton):
    with pytest.raises(FlaKernelsUnavailableError, match=r"install Triton >= 3\.7\.1"):
        refuse_fla_hopper_backward()


def test_cuda_training_without_fla_installed_is_one_clear_error(monkeypatch):
    from models.qwen35_moe.kernels.gated_delta_rule import require_fla

    monkeypatch.setattr(gdr.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FlaKernelsUnavailableError, match=r"pip install -e '\.\[gpu\]'"):
        require_fla()


@pytest.mark.parametrize("installed, warns", [("0.6.0", False), ("0.7.0", True)])
def test_an_fla_release_its_internals_were_not_checked_on_is_named_once(monkeypatch, caplog, installed, warns):
    monkeypatch.setattr(gdr.importlib.metadata, "version", lambda name: installed)
    gdr.warn_if_fla_unchecked.cache_clear()
    for _ in range(2):
        gdr.warn_if_fla_unchecked()
    gdr.warn_if_fla_unchecked.cache_clear()
    named = [r for r in caplog.records if "test_fla_hopper_guard.py" in r.getMessage()]
    assert len(named) == (1 if warns else 0) and all(installed in r.getMessage() for r in named)
