"""FastAdam's CUDA step (harness/optim/fast_adam.py, one Triton kernel per parameter group) against a float64 Adam/AdamW
written out here (torch's fused step on the same inputs printed alongside): three steps, with and without a
gradient scale (the folded clipping), decay and no-decay groups, sizes that do not fill the kernel's last block;
and a state that starts as torch's fused optimizer left it (a checkpoint saved by torch's fused AdamW: its step
counts live on the GPU).

FastAdam's math is fp32, so it must land within fp32 rounding of the float64 result: the parameters to a few
units in their last place (rtol 5e-7, ~4 ulp; atol 2.5e-7, 2 ulp at 1, for values that cancel towards 0), the
moments to 1e-6 (atol 5e-7: their terms reach ~1.5, and a sum that cancels keeps their rounding)."""

from __future__ import annotations

import math

import pytest
import torch

from harness.optim.fast_adam import FastAdam

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = [(3,), (1000, 7), (2049, 1025)]
LR, BETAS, EPS, DECAY = 1e-2, (0.9, 0.95), 1e-8, [0.0, 0.1, 0.1]  # parameter 0 in the no-decay group


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).cuda()) for s in SHAPES]


def _grads(step: int, decoupled: bool = True) -> list[torch.Tensor]:
    """Gradients of N(0, 9). For Adam's L2 decay (gradient + decay * parameter) of the parameter's sign: where the
    two cancel, the fp32 gradient is its rounding alone and any fp32 Adam (torch's fused one too: 2.4e-6 measured)
    lands away from the float64 step; not what this test is about."""
    g = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(s, generator=g).cuda() * 3 for s in SHAPES]
    if not decoupled:
        grads = [grad.abs() * p.detach().sign() for grad, p in zip(grads, _params())]
    return grads


def _groups(params):
    return [{"params": params[1:], "weight_decay": DECAY[1]}, {"params": params[:1], "weight_decay": DECAY[0]}]


def _steps(optimizer, params, steps, scale, first=0, decoupled=True):
    for step in range(first, first + steps):
        for p, g in zip(params, _grads(step, decoupled)):
            p.grad = g
        optimizer.grad_scale = torch.tensor(scale, device="cuda") if scale != 1 else None
        optimizer.step()


def _float64_adam(decoupled: bool, scale: float, steps: int):
    params = [p.detach().double() for p in _params()]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for t in range(1, steps + 1):
        for i, g in enumerate(_grads(t - 1, decoupled)):
            g = g.double() / scale
            if decoupled:
                params[i] *= 1 - LR * DECAY[i]
            else:
                g = g + DECAY[i] * params[i]
            m[i] = BETAS[0] * m[i] + (1 - BETAS[0]) * g
            v[i] = BETAS[1] * v[i] + (1 - BETAS[1]) * g * g
            denom = v[i].sqrt() / math.sqrt(1 - BETAS[1] ** t) + EPS
            params[i] -= LR / (1 - BETAS[0] ** t) * m[i] / denom
    return params, m, v


def _largest_errors(params, want_p, name):
    for i, p in enumerate(params):
        err = ((p.detach().double() - want_p[i]).abs() / want_p[i].abs().clamp(min=0.5)).max().item()
        print(f"{name} parameter {i}: largest relative error {err:.1e}")


def _assert_near(params, optimizer, want, name):
    want_p, want_m, want_v = want
    _largest_errors(params, want_p, name)
    for i, p in enumerate(params):
        state = optimizer.state[p]
        torch.testing.assert_close(p.detach().double(), want_p[i], rtol=5e-7, atol=2.5e-7, msg=f"{name} param {i}")
        torch.testing.assert_close(state["exp_avg"].double(), want_m[i], rtol=1e-6, atol=5e-7)
        torch.testing.assert_close(state["exp_avg_sq"].double(), want_v[i], rtol=1e-6, atol=5e-7)


@pytest.mark.parametrize("scale", [1.0, 2.5])
@pytest.mark.parametrize("decoupled", [True, False])
def test_fast_adam_matches_float64_adam(decoupled, scale):
    want = _float64_adam(decoupled, scale, steps=3)
    start = _params()
    assert all((a.double() - b).abs().max() > 1e-3 for a, b in zip(start, want[0]))  # the steps move every tensor
    params = _params()
    optimizer = FastAdam(_groups(params), lr=LR, betas=BETAS, eps=EPS, decoupled_weight_decay=decoupled)
    _steps(optimizer, params, 3, scale, decoupled=decoupled)
    _assert_near(params, optimizer, want, "FastAdam")
    # For the record, torch's fused step on the same inputs (measured on an H200: 8e-8 to 3e-7 like FastAdam)
    params = _params()
    _steps((torch.optim.AdamW if decoupled else torch.optim.Adam)(_groups(params), lr=LR, betas=BETAS, eps=EPS,
                                                                   fused=True), params, 3, scale, decoupled=decoupled)
    _largest_errors(params, want[0], "torch fused")


def test_fast_adam_resumes_torch_fused_state():
    """Two steps of torch's fused AdamW, its state dict loaded into FastAdam, a third step by FastAdam."""
    params = _params()
    fused = torch.optim.AdamW(_groups(params), lr=LR, betas=BETAS, eps=EPS, fused=True)
    _steps(fused, params, 2, 1.0)
    assert fused.state[params[0]]["step"].is_cuda
    fast = FastAdam(_groups(params), lr=LR, betas=BETAS, eps=EPS)
    fast.load_state_dict(fused.state_dict())
    _steps(fast, params, 1, 1.0, first=2)
    _assert_near(params, fast, _float64_adam(True, 1.0, steps=3), "resumed")


def _kept_copies(a, b, dtype, grads_in_copies=False):
    """Kept copies in `dtype` (parallel/one_device_precision.py) of two weights, `a` and `b`, of one module."""
    from parallel.one_device_precision import OneDevicePrecision

    module = torch.nn.Module()
    module.a, module.b = a, b
    copies = OneDevicePrecision(dtype, grads_in_copies=grads_in_copies)
    copies.reader(module)
    copies.before_forward()  # makes them, as the model's forward does
    return copies


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fast_adam_writes_the_kept_copies_as_a_cast_of_the_updated_parameters(dtype):
    """The kept copies (parallel/one_device_precision.py): after each step the kernel's copy is bitwise the updated fp32
    parameter cast by torch (round to nearest even), and the parameters are the same as without copies. The
    parameters' version counters do not move, so the model does not recast the copies."""
    params, plain = _params(), _params()
    copies = _kept_copies(params[1], params[2], dtype)  # params[0] without one
    with_copies = FastAdam(_groups(params), lr=LR, betas=BETAS, eps=EPS, weight_copies=copies)
    without = FastAdam(_groups(plain), lr=LR, betas=BETAS, eps=EPS)
    versions = [p._version for p in params]
    for step in range(3):
        _steps(with_copies, params, 1, 2.0, first=step)
        _steps(without, plain, 1, 2.0, first=step)
        for (weight, copy), i in zip(copies.pairs, (1, 2)):
            assert weight is params[i] and copy.dtype == dtype
            assert torch.equal(copy, weight.detach().to(dtype)), (step, i)
        for p, q in zip(params, plain):
            assert torch.equal(p, q)
    assert [p._version for p in params] == versions


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fast_adam_reads_half_precision_gradients_as_their_fp32_upcasts(dtype):
    """Weight copies holding their weights' gradients (parallel/one_device_precision.py, grads_in_copies): the kernel
    reads those in bf16 / fp16. Reference: the same kernel fed each gradient upcast to fp32, which is exact. Three
    scaled steps leave bitwise the same parameters and moments."""
    half, full = _params(), _params()
    copies = _kept_copies(*half[1:], dtype, grads_in_copies=True)
    optimizers = [FastAdam(_groups(half), lr=LR, betas=BETAS, eps=EPS, weight_copies=copies),
                  FastAdam(_groups(full), lr=LR, betas=BETAS, eps=EPS)]
    for step in range(3):
        rounded = [g.to(dtype) for g in _grads(step)]
        half[0].grad, full[0].grad = rounded[0].float(), rounded[0].float()
        for (weight, copy), g, q in zip(copies.pairs, rounded[1:], full[1:]):
            weight.grad, copy.grad, q.grad = None, g, g.float()
        for optimizer in optimizers:
            optimizer.grad_scale = torch.tensor(2.0, device="cuda")
            optimizer.step()
    for p, q in zip(half, full):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizers[0].state[p][key], optimizers[1].state[q][key])


def test_fast_adam_steps_a_group_in_one_launch_as_one_launch_per_parameter():
    """FastAdam launches one kernel per parameter group (a launch per parameter costs 7-9 ms of host time a step:
    docs/performance.md, "Tried, not kept"); that launch leaves bitwise what one launch per parameter leaves (the same
    arithmetic per value), over sizes that end mid-block, bf16 gradients and kept bf16 copies; vectorised (every
    address 16-byte aligned) and not (one gradient starts 2 bytes into its buffer, as a shard's gradient may)."""
    from harness.optim.adam_step_triton import adam_steps_

    g = torch.Generator().manual_seed(1)
    shapes = SHAPES + [(4096, 3), (5,)]
    hyper = dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=0.1, decoupled=True,
                 bias_correction1=1 - BETAS[0] ** 2, bias_correction2_sqrt=math.sqrt(1 - BETAS[1] ** 2),
                 grad_scale=torch.tensor(2.0, device="cuda"))
    for unaligned in (False, True):
        columns = [[torch.randn(s, generator=g).cuda() for s in shapes],
                   [torch.randn(s, generator=g).cuda().bfloat16() for s in shapes],
                   [torch.randn(s, generator=g).cuda() for s in shapes],
                   [torch.rand(s, generator=g).cuda() for s in shapes],
                   [torch.zeros(s, device="cuda", dtype=torch.bfloat16) for s in shapes]]
        if unaligned:
            columns[1][-1] = torch.randn(6, generator=g).cuda().bfloat16()[1:]
            assert columns[1][-1].data_ptr() % 16 != 0
        single = [[t.clone() for t in column] for column in columns]
        kernel = adam_steps_(*columns, **hyper)
        # 128-bit loads where every address is aligned (the unaligned variant would run 2-4x the instructions)
        assert ("ld.global.v4" in kernel.asm["ptx"]) == (not unaligned)
        for i in range(len(shapes)):
            adam_steps_(*[[column[i]] for column in single], **hyper)
        for a, b in zip(columns, single):
            assert all(torch.equal(x, y) for x, y in zip(a, b))

    params = _params()
    optimizer = FastAdam(_groups(params), lr=LR, betas=BETAS, eps=EPS)
    for p, grad in zip(params, _grads(0)):
        p.grad = grad
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        optimizer.step()
        torch.cuda.synchronize()
    launches = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "_adam_steps" in e.name]
    assert len(launches) == len(optimizer.param_groups)
