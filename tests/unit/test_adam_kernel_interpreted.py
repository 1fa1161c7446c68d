"""harness/optim/adam_step_triton.py's batched launch run by Triton's interpreter on CPU (TRITON_INTERPRET=1, in a
subprocess: the switch is read when Triton is imported). What CPU can check of the CUDA kernel is its plumbing:
the address table, the block map, the unmasked full blocks and the unaligned variant. Parameters of sizes that end
mid-block, fp32 and bf16 gradients (one starting mid-buffer), kept copies: one launch over all of them must equal
one launch per tensor bitwise (the same arithmetic per value), and torch's Adam math (adam_step_torch_) to fp32
rounding (rtol 5e-5: the interpreter evaluates in numpy, which may order and round fp32 differently from torch's
CPU ops; the CUDA kernel's own accuracy and vectorisation are tests/gpu/test_fast_adam.py's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = r'''
import torch
from harness.optim.adam_step_triton import adam_steps_
from harness.optim.fast_adam import adam_step_torch_

g = torch.Generator().manual_seed(0)
shapes = [(3,), (1000, 7), (4097,), (2, 3, 5)]
hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True,
             bias_correction1=1 - 0.9 ** 3, bias_correction2_sqrt=(1 - 0.95 ** 3) ** 0.5, grad_scale=torch.tensor(2.0))
for grad_dtype in (torch.float32, torch.bfloat16):
    batched = [[torch.randn(s, generator=g) for s in shapes], [torch.randn(s, generator=g).to(grad_dtype) for s in shapes],
               [torch.randn(s, generator=g) for s in shapes], [torch.rand(s, generator=g) for s in shapes],
               [torch.zeros(s, dtype=torch.bfloat16) for s in shapes]]
    batched[1][0] = torch.randn(4, generator=g).to(grad_dtype)[1:]  # unaligned: the launch's unvectorised variant
    single = [[t.clone() for t in column] for column in batched]
    reference = [[t.clone() for t in column] for column in batched]
    adam_steps_(*batched, **hyper)
    for i in range(len(shapes)):
        adam_steps_(*[[column[i]] for column in single], **hyper)
        adam_step_torch_(*[column[i] for column in reference[:4]], **hyper)
    for name, a, b, r in zip(("param", "grad", "exp_avg", "exp_avg_sq", "copy"), batched, single, reference):
        for x, y, z in zip(a, b, r):
            assert torch.equal(x, y), name
            if name != "copy":
                torch.testing.assert_close(x, z, rtol=5e-5, atol=1e-7, msg=name)
    for copy, param in zip(batched[4], batched[0]):  # the interpreter rounds to bf16 its own way: within one ulp
        torch.testing.assert_close(copy.float(), param, rtol=2 ** -7, atol=0)
print("ok")
'''


def test_one_launch_for_many_tensors_is_one_launch_per_tensor_and_adams_math():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
