"""The causal conv + SiLU kernel (kernels/causal_conv_triton.py) against the float64 torch reference of the same bf16
inputs, and against FLA's kernel, the implementation it replaced.

Rows pack documents shorter and longer than the kernel width, and one row starts mid-document (its first
position is not 0), which must still reset the taps. Tolerances: the kernel sums in fp32 and rounds once to
bf16, so its outputs and dx sit within a bf16 rounding (2^-8 relative) of float64, and its weight gradient,
summed in fp32 over every token and returned in fp32, within 1e-5 in norm; a misplaced tap or a missed document
start moves values by O(1)."""

import pytest
import torch

from models.qwen35_moe.documents import document_layout
from models.qwen35_moe.kernels.causal_conv import causal_conv1d_qkv, torch_causal_conv1d

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels need a CUDA GPU")

W = 4
PARTS = (256, 256, 512)  # q, k, v channels (two key heads, four value heads of 128)
ROW = 700  # tokens per row; three rows make 2100 tokens, several of the backward's 256-row blocks


def packed_positions() -> torch.Tensor:
    """(3, ROW) positions: row 0 documents of 1, 2, 3, 5 and the rest; row 1 continues a document (starts at
    position 40), then documents of 64 and the rest; row 2 one document."""
    def docs(*lengths):
        return torch.cat([torch.arange(n) for n in lengths])
    row0 = docs(1, 2, 3, 5, ROW - 11)
    row1 = torch.cat([torch.arange(40, 140), docs(64, ROW - 164)])
    return torch.stack([row0, row1, torch.arange(ROW)])


def cu_seqlens_of(positions: torch.Tensor) -> torch.Tensor:
    """The packed documents over the flattened rows, as the model derives them for the torch path."""
    return document_layout(positions.cpu(), *positions.shape, torch.device("cpu")).cu_seqlens


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    c = sum(PARTS)
    x = torch.randn(1, 3 * ROW, c, generator=gen).to("cuda", torch.bfloat16)
    weight = (torch.randn(c, W, generator=gen) / W ** 0.5).to("cuda", torch.bfloat16)
    grads = [torch.randn(1, 3 * ROW, p, generator=gen).to("cuda", torch.bfloat16) for p in PARTS]
    return x, weight, grads


def outputs_and_grads(fn, x, weight, grads):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    outs = fn(x, weight)
    dx, dweight = torch.autograd.grad(outs, (x, weight), grads)
    return [*outs, dx, dweight]


def reference(x, weight, grads, cu_seqlens):
    """float64 torch conv of the same bf16 values, split like the kernel's outputs."""
    def conv(x, w):
        return torch_causal_conv1d(x, w, cu_seqlens).split(PARTS, dim=-1)
    return outputs_and_grads(conv, x.double(), weight.double(), [g.double() for g in grads])


def test_matches_float64_reference_with_packed_documents():
    positions = packed_positions().cuda()
    cu = cu_seqlens_of(positions)
    x, weight, grads = inputs()
    weight = weight.float()  # bf16 values; an fp32 weight gets its gradient in fp32, unrounded
    actual = outputs_and_grads(lambda x, w: causal_conv1d_qkv(x, w, PARTS, positions), x, weight, grads)
    expected = reference(x, weight, grads, cu.cuda())
    for name, a, e in zip(["q", "k", "v", "dx"], actual[:4], expected[:4]):
        assert a.dtype == torch.bfloat16 and a.is_contiguous(), name
        torch.testing.assert_close(a.double(), e, rtol=2 ** -8, atol=1e-5, msg=name)
    dweight, expected_dweight = actual[4], expected[4]
    assert dweight.dtype == torch.float32
    assert ((dweight.double() - expected_dweight).norm() / expected_dweight.norm()).item() < 1e-5


def test_document_starts_reset_the_taps():
    """The same inputs with the documents ignored (one per row) give different outputs: the resets are live."""
    positions = packed_positions().cuda()
    x, weight, _ = inputs()
    packed = causal_conv1d_qkv(x, weight, PARTS, positions)
    rows = causal_conv1d_qkv(x, weight, PARTS, torch.arange(ROW, device="cuda").expand(3, ROW))
    unpacked_reference = torch_causal_conv1d(x.double().view(3, ROW, -1), weight.double()).view(1, 3 * ROW, -1)
    torch.testing.assert_close(torch.cat(rows, -1).double(), unpacked_reference, rtol=2 ** -8, atol=1e-5)
    assert not torch.equal(packed[0], rows[0])


def test_matches_flas_kernel():
    from fla.modules.causal_conv1d import causal_conv1d as fla_causal_conv1d

    positions = packed_positions().cuda()
    cu = cu_seqlens_of(positions).cuda()
    x, weight, grads = inputs(seed=1)

    def fla(x, w):
        y, _ = fla_causal_conv1d(x, w, activation="silu", cu_seqlens=cu)
        return y.split(PARTS, dim=-1)
    ours = outputs_and_grads(lambda x, w: causal_conv1d_qkv(x, w, PARTS, positions), x, weight, grads)
    flas = outputs_and_grads(fla, x, weight, grads)
    for name, a, b in zip(["q", "k", "v", "dx", "dweight"], ours, flas):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 4e-3, name


def test_an_unused_output_gets_zero_gradient_and_compiled_equals_eager():
    """Only q and v used (k's gradient is None); the op compiles into the graph (fullgraph) and gives eager's
    results bitwise."""
    positions = packed_positions().cuda()
    x, weight, grads = inputs(seed=2)

    def q_and_v(x, w):
        q, _, v = causal_conv1d_qkv(x, w, PARTS, positions)
        return q, v

    results = []
    for fn in (q_and_v, torch.compile(q_and_v, fullgraph=True)):
        xs, ws = x.detach().requires_grad_(), weight.detach().requires_grad_()
        q, v = fn(xs, ws)
        results.append([q, v, *torch.autograd.grad((q, v), (xs, ws), (grads[0], grads[2]))])
    for a, b in zip(*results):
        assert torch.equal(a, b)

    xs, ws = x.double().requires_grad_(), weight.double().requires_grad_()
    q, _, v = torch_causal_conv1d(xs, ws, cu_seqlens_of(positions).cuda()).split(PARTS, dim=-1)
    dx, _ = torch.autograd.grad((q, v), (xs, ws), (grads[0].double(), grads[2].double()))
    torch.testing.assert_close(results[0][2].double(), dx, rtol=2 ** -8, atol=1e-5)
