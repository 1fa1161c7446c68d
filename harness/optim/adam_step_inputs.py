"""What the Triton Adam step (adam_step_triton.py) takes, for FastAdam (fast_adam.py) to choose its tensors by,
without importing Triton."""

from __future__ import annotations

import torch

# The kernel's 128-bit loads need every address of a launch to be a multiple of this many bytes: adam_step_triton.py
# promises it to the compiler only where a launch's addresses all are, and FastAdam launches the others apart.
KERNEL_ALIGNMENT = 16


def fits_kernel_dtypes(param, grad, exp_avg, exp_avg_sq) -> bool:
    """The kernel's dtypes (adam_step_triton.py checks its inputs with this too): fp32, the gradient also bf16 or
    fp16 (a weight copy's)."""
    return (all(t.dtype == torch.float32 for t in (param, exp_avg, exp_avg_sq))
            and grad.dtype in (torch.float32, torch.bfloat16, torch.float16))
