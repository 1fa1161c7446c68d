"""The fp32 checkpoint contract of Gated DeltaNet's SSM gate parameters.

`A_log` and `dt_bias` set the per-head decay rate exp(-exp(A_log) * softplus(a + dt_bias)) that the
recurrence compounds over the whole sequence, so a bf16 rounding of them is a proportional error on
the decay rate. They are therefore stored, all-gathered and computed in fp32 whatever the model dtype.

Natively they live in an `SSMGate` registered as `<layer>.linear_attn._fp32_params`, so native keys read
`...linear_attn._fp32_params.A_log`. Hugging Face checkpoints name them bare (`...linear_attn.A_log`):
the state-dict adapter strips the holder on export, routes bare keys into it on load, and upcasts
these tensors when a checkpoint holds them in lower precision.
"""

from __future__ import annotations

import torch
from torch import nn

HOLDER_NAME = "_fp32_params"
FP32_GDN_PARAM_NAMES = ("A_log", "dt_bias")
# Architectures whose official checkpoints keep A_log / dt_bias in fp32.
GDN_FP32_CHECKPOINT_ARCHITECTURES = frozenset(
    (
        "Qwen3NextForCausalLM",
        "Qwen3_5ForCausalLM",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeForConditionalGeneration",
    )
)

_LINEAR_ATTN = ".linear_attn."


def _split(key: str) -> tuple[str, str] | None:
    """(prefix up to and including '.linear_attn.', remainder), or None when not under linear_attn."""
    i = key.rfind(_LINEAR_ATTN)
    if i < 0:
        return None
    cut = i + len(_LINEAR_ATTN)
    return key[:cut], key[cut:]


def is_gated_delta_net_fp32_param_key(key: str) -> bool:
    """True for `...linear_attn.A_log` / `dt_bias`, with or without the `_fp32_params.` holder."""
    parts = _split(key)
    if parts is None:
        return False
    rest = parts[1].removeprefix(HOLDER_NAME + ".")
    return rest in FP32_GDN_PARAM_NAMES


def route_fp32_holder_key(key: str) -> str:
    """`...linear_attn.A_log` -> `...linear_attn._fp32_params.A_log`; any other key unchanged."""
    parts = _split(key)
    if parts is None or parts[1] not in FP32_GDN_PARAM_NAMES:
        return key
    return f"{parts[0]}{HOLDER_NAME}.{parts[1]}"


def strip_fp32_holder_key(key: str) -> str:
    """`...linear_attn._fp32_params.A_log` -> `...linear_attn.A_log`; any other key unchanged."""
    parts = _split(key)
    if parts is None:
        return key
    rest = parts[1]
    if rest.startswith(HOLDER_NAME + ".") and rest[len(HOLDER_NAME) + 1 :] in FP32_GDN_PARAM_NAMES:
        return parts[0] + rest[len(HOLDER_NAME) + 1 :]
    return key


def upcast_gated_delta_net_fp32_state_tensor(key: str, tensor: torch.Tensor) -> torch.Tensor:
    """Return `tensor` in fp32 when `key` is an fp32 GDN parameter held in lower precision."""
    if (
        is_gated_delta_net_fp32_param_key(key)
        and tensor.is_floating_point()
        and tensor.dtype != torch.float32
        and torch.finfo(tensor.dtype).bits < 32
    ):
        return tensor.to(torch.float32)
    return tensor


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """fp32, or the given dtype when it is wider (a float64 reference run keeps everything in float64)."""
    return torch.promote_types(dtype, torch.float32)


class Fp32ParamsModule(nn.Module):
    """A module whose floating parameters stay at least fp32 through any `.to(dtype)`, `.half()` or `to_empty()`
    of the model (all funnel through `_apply`): the device follows, the precision never drops below fp32.
    Used by the SSM gate and the GDN output norm; they are created in at_least_fp32(default dtype)."""

    def _apply(self, fn, recurse=True):
        def keep_fp32(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if not out.is_floating_point() or torch.finfo(out.dtype).bits >= 32:
                return out
            # A lowering dtype conversion: take only its device, from the original values (no rounding trip).
            dtype = at_least_fp32(t.dtype)
            return out.to(dtype) if t.is_meta or out.is_meta else t.to(device=out.device, dtype=dtype)

        return super()._apply(keep_fp32, recurse)
