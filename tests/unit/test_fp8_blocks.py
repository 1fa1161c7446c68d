"""models/qwen35_moe/fp8_blocks.py against a float64 reference written here from the format's definition: one scale
per 128 x 128 block (edge blocks cut short) taking the block's amax to 448, e4m3 round-to-nearest-even, an all-zero
block a scale of 1; dequantizing multiplies each value by its block's scale."""

from __future__ import annotations

import math

import pytest
import torch

from models.qwen35_moe.fp8_blocks import dequantize_blocks, dequantize_stacked, quantize_blocks, scale_shape

BLOCK, E4M3_MAX = 128, 448.0


def e4m3_nearest(x: torch.Tensor) -> torch.Tensor:
    """The float8_e4m3fn value nearest to each float64 `x` (|x| <= 448), ties to even: 3 mantissa bits, so the
    spacing in [2^k, 2^(k+1)) is 2^(k-3); below the least normal 2^-6 the subnormals keep its spacing, 2^-9."""
    _, exponent = torch.frexp(x.abs().clamp(min=2.0**-6))  # |x| = m * 2^exponent, m in [0.5, 1)
    spacing = torch.ldexp(torch.ones_like(x), exponent - 4)
    return torch.round(x / spacing) * spacing  # torch.round: half to even


def per_element(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Each block's scale over its elements, cut at the bottom and right edges."""
    return scale.repeat_interleave(BLOCK, -2)[..., :rows, :].repeat_interleave(BLOCK, -1)[..., :cols]


def reference_quantize(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the e4m3 values, the scales, the exact quotients w / scale) in float64, block by block."""
    w = w.double()
    *lead, rows, cols = w.shape
    scale = torch.empty(*lead, math.ceil(rows / BLOCK), math.ceil(cols / BLOCK), dtype=torch.float64)
    for i in range(scale.shape[-2]):
        for j in range(scale.shape[-1]):
            amax = w[..., i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].abs().amax(dim=(-2, -1))
            scale[..., i, j] = torch.where(amax > 0, amax / E4M3_MAX, 1.0).to(scale_dtype).double()
    quotient = (w / per_element(scale, rows, cols)).clamp(-E4M3_MAX, E4M3_MAX)
    return e4m3_nearest(quotient), scale, quotient


def weights(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """N(0, 0.02) in float32, the magnitudes of initial weights, with a few far smaller (subnormal after scaling)."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02
    w.view(-1)[::97] *= 1e-4
    return w


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(300, 200), (3, 256, 129), (1, 1), (128, 128), (2, 256, 384)])
def test_quantize_blocks_is_the_float64_reference(shape, scale_dtype):
    w = weights(shape, seed=sum(shape))
    fp8, scale = quantize_blocks(w, scale_dtype=scale_dtype)
    expected, expected_scale, quotient = reference_quantize(w, scale_dtype)
    assert fp8.dtype == torch.float8_e4m3fn and fp8.shape == w.shape
    assert scale.dtype == scale_dtype and tuple(scale.shape) == scale_shape(shape) == tuple(expected_scale.shape)
    # The scale is amax / 448 rounded once to its dtype (fp32's correctly rounded division then a narrowing:
    # double rounding is harmless at 24 >= 2 * 8 + 2 bits): exact.
    assert torch.equal(scale.double(), expected_scale)
    # fp8_blocks divides in float32 before rounding to e4m3; the reference in float64. They agree but where the
    # quotient lies within float32's rounding (2^-24 relative) of a midpoint between two e4m3 values.
    differs = fp8.double() != expected
    spacing = torch.ldexp(torch.ones_like(quotient), torch.frexp(quotient.abs().clamp(min=2.0**-6))[1] - 4)
    near_tie = ((quotient / spacing).frac().abs() - 0.5).abs() < 2.0**-20
    assert not (differs & ~near_tie).any(), quotient[differs & ~near_tie][:5]

    rows, cols = shape[-2:]
    deq = fp8.double() * per_element(scale.double(), rows, cols)
    assert torch.equal(dequantize_blocks(fp8, scale, torch.float64), deq)  # e4m3 x scale: exact in float64
    assert torch.equal(dequantize_blocks(fp8, scale), deq.float())  # one rounding to float32
    # e4m3 keeps 3 mantissa bits: round-to-nearest is within half a spacing, 2^-4 of |w| for a normal value; below
    # the least normal the spacing is scale * 2^-9. (A bf16 scale a little under amax / 448 clamps the block's
    # largest value to 448: under 2^-8 of it.)
    tolerance = w.double().abs() * 2.0**-4 + per_element(scale.double(), rows, cols) * 2.0**-9
    assert ((deq - w.double()).abs() <= tolerance).all()


def test_a_zero_block_has_scale_one_and_a_block_reaching_448_dequantizes_exactly():
    w = weights((300, 200), seed=0).clamp(-0.1, 0.1)
    w[128:256, :128] = 0  # block (1, 0)
    w[5, 130] = E4M3_MAX * 2.0**-10  # block (0, 1): amax 0.4375, scale exactly 2^-10 in fp32 and bf16
    w[299, 199] = -3.5  # block (2, 1), the corner cut to 44 x 72: amax 448 * 2^-7
    for scale_dtype in (torch.float32, torch.bfloat16):
        fp8, scale = quantize_blocks(w, scale_dtype=scale_dtype)
        assert scale[1, 0] == 1 and not fp8[128:256, :128].float().any()
        assert scale[0, 1] == 2.0**-10 and fp8[5, 130].float() == E4M3_MAX
        assert scale[2, 1] == 2.0**-7 and fp8[299, 199].float() == -E4M3_MAX
        deq = dequantize_blocks(fp8, scale, torch.float64)
        assert deq[5, 130] == w[5, 130] and deq[299, 199] == -3.5 and not deq[128:256, :128].any()


def test_dequantize_blocks_refuses_scales_of_another_shape():
    fp8, scale = quantize_blocks(weights((300, 200), seed=1))
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape \(2, 2\).*needs \(3, 2\)"):
        dequantize_blocks(fp8, scale[:2])
    experts, experts_scale = quantize_blocks(weights((3, 256, 129), seed=2))
    with pytest.raises(ValueError, match=r"needs \(3, 2, 2\)"):
        dequantize_blocks(experts, experts_scale[0])


@pytest.mark.parametrize("rows", [32, 200, 256])
def test_stacked_weights_dequantize_each_with_its_own_blocks(rows):
    """The routed experts' gate/up: two weights of `rows` rows quantized apart, values and scales stacked along the
    rows. Each half dequantizes with its own scales (float64 definition), also where `rows` is not a multiple of 128
    and the stacked weight's blocks are not the halves' blocks."""
    gate, up = weights((3, rows, 160), seed=rows), weights((3, rows, 160), seed=rows + 1) * 3
    (gate8, gate_scale), (up8, up_scale) = quantize_blocks(gate), quantize_blocks(up)
    stacked = dequantize_stacked(torch.cat([gate8, up8], 1), torch.cat([gate_scale, up_scale], 1), 2, torch.float64)
    expected = torch.cat([gate8.double() * per_element(gate_scale.double(), rows, 160),
                          up8.double() * per_element(up_scale.double(), rows, 160)], 1)
    assert torch.equal(stacked, expected)
