"""The fused MoE combine (models/qwen35_moe/kernels/moe_combine_triton.py) against float64 references of the same bf16
inputs, and inside a compiled graph.

The kernels sum in fp32 and round once: an fp32 output equals the float64 sum to fp32 rounding (a few terms), a
bf16 output or gradient row equals the float64 value rounded once to bf16, give or take the last bit (fp32
partial sums, or the fp32 product w * g rounded before bf16, can land across a rounding boundary). Sizes: k = 8
(Qwen3.5's top-k) and k = 3 (padded to a block of 4); widths that are not a multiple of the column block.
"""

from __future__ import annotations

import pytest
import torch

from models.qwen35_moe.moe import combine_expert_outputs, expert_counts, gather_rows, inverse_permutation

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BF16_ULP = 2.0 ** -7  # relative spacing of bf16 at the bottom of a binade: one last-bit flip at most
# A sum whose terms cancel keeps the fp32 error of its terms: k = 8 terms of |x| < 6, 2^-24 each.
FP32_SUM_ERR = 8 * 6 * 2.0 ** -24


def _inputs(n: int, k: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randn(n * k, d, generator=g).to(torch.bfloat16).cuda()
    index = torch.randperm(n * k, generator=g).cuda()
    weights = torch.rand(n, k, generator=g).softmax(-1).cuda()
    grad_out = torch.randn(n, d, generator=g).to(torch.bfloat16).cuda()
    return src, index, weights, grad_out


def _assert_rounded_once(ours: torch.Tensor, exact: torch.Tensor, summed: bool = True) -> None:
    torch.testing.assert_close(ours.double(), exact, rtol=BF16_ULP, atol=FP32_SUM_ERR if summed else 1e-30)


@pytest.mark.parametrize("n,k,d", [(300, 8, 2096), (77, 3, 200)])
def test_weighted_row_sum_and_its_gradients_equal_float64(n, k, d):
    from models.qwen35_moe.kernels.moe_combine_triton import weighted_row_sum

    src, index, weights, grad_out = _inputs(n, k, d)
    src64 = src.double().requires_grad_()
    w64 = weights.double().requires_grad_()
    exact = (src64[index].view(n, k, d) * w64[..., None]).sum(1)
    exact.backward(grad_out.double())

    fp32 = weighted_row_sum(src, index, weights, torch.float32)
    torch.testing.assert_close(fp32.double(), exact.detach(), rtol=1e-6, atol=1e-6)
    _assert_rounded_once(weighted_row_sum(src, index, weights, torch.bfloat16), exact.detach())

    src_ = src.clone().requires_grad_()
    w_ = weights.clone().requires_grad_()
    weighted_row_sum(src_, index, w_, torch.bfloat16).backward(grad_out)
    _assert_rounded_once(src_.grad, src64.grad, summed=False)  # w * g: one product
    assert w_.grad.dtype == torch.float32
    torch.testing.assert_close(w_.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)


def test_forward_sums_do_not_depend_on_the_tile_or_the_output_dtype():
    """Every autotune config gives the same fp32 sums bitwise, and the bf16 output is their rounding: the
    autotuner picks per output dtype, and expert parallelism's fp32 partial sums, rounded after its exchange,
    must give the bf16 path's outputs bitwise (tests/gpu/test_expert_parallel_cuda.py)."""
    import triton

    from models.qwen35_moe.kernels.moe_combine_triton import _weighted_row_sum, weighted_row_sum

    n, k, d = 300, 8, 2096
    src, index, weights, _ = _inputs(n, k, d, seed=3)
    sums = []
    for config in _weighted_row_sum.configs:
        out = torch.empty(n, d, device="cuda")
        block = config.kwargs["BLOCK_D"]
        _weighted_row_sum.fn[(n, triton.cdiv(d, block))](src, index, weights, index, out, d, K=k, HAS_WEIGHTS=True,
                                                         HAS_LIMIT=False, BLOCK_D=block, num_warps=config.num_warps)
        sums.append(out)
    for other in sums[1:]:
        assert torch.equal(other, sums[0])
    assert torch.equal(weighted_row_sum(src, index, weights, torch.bfloat16), sums[0].to(torch.bfloat16))


def test_row_group_sum_equals_float64_sum():
    from models.qwen35_moe.kernels.moe_combine_triton import row_group_sum

    n, k, d = 300, 8, 2096
    src, index, _, _ = _inputs(n, k, d, seed=1)
    ours = row_group_sum(src, index, k)
    assert ours.dtype == torch.bfloat16
    _assert_rounded_once(ours, src.double()[index].view(n, k, d).sum(1))


def _layer_results(run_layer, seed: int, n: int = 256, k: int = 8, d: int = 512, experts: int = 16):
    """The outputs and the x and weight gradients of `run_layer(x, weights, ids, scale)` (combine_expert_outputs with
    a per-row scaling standing in for the experts) on the same bf16 inputs: in float64 on CPU (the torch path), in
    bf16 on CUDA eager, and compiled with fullgraph=True (fails on a graph break). Also returns the expert ids."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g).to(torch.bfloat16)
    ids = torch.randn(n, experts, generator=g).topk(k, -1).indices
    weights = torch.rand(n, k, generator=g).softmax(-1)  # fp32, as the router gives them
    scale = (torch.rand(d, generator=g) + 0.5).to(torch.bfloat16)
    grad_out = torch.randn(n, d, generator=g).to(torch.bfloat16)

    def outputs_and_grads(fn, dtype, device):
        weights_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        leaves = [t.to(device, dt).clone().requires_grad_() for t, dt in ((x, dtype), (weights, weights_dtype))]
        out = fn(leaves[0], leaves[1], ids.to(device), scale.to(device, dtype))
        out.backward(grad_out.to(device, out.dtype))
        return [t.detach().double().cpu() for t in (out, leaves[0].grad, leaves[1].grad)]

    exact = outputs_and_grads(run_layer, torch.float64, "cpu")
    eager = outputs_and_grads(run_layer, torch.bfloat16, "cuda")
    compiled = outputs_and_grads(torch.compile(run_layer, fullgraph=True), torch.bfloat16, "cuda")
    return exact, eager, compiled, ids


def _assert_close_to_float64_and_compiled_equal(exact, eager, compiled) -> None:
    # Error budget: one bf16 rounding of each scaled row (the stand-in expert) and of the sum; the weights'
    # gradient is a 512-term dot product of such rows.
    for ours, want, atol in zip(eager, exact, (1e-2, 1e-2, 1e-1)):
        torch.testing.assert_close(ours, want, rtol=1e-2, atol=atol)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_layer_combine_matches_float64_and_compiles_without_graph_break():
    """combine_expert_outputs on CUDA bf16 (both kernels: the combine, and the token gather's backward) against the
    float64 torch path of the same bf16 inputs; eager and compiled agree bitwise."""
    experts = 16

    def layer(x, weights, ids, scale):
        run = lambda rows, counts: rows * scale  # noqa: E731 (per row, so the expert order does not matter)
        return combine_expert_outputs(x, weights, ids, expert_counts(ids, experts), run)

    exact, eager, compiled, _ = _layer_results(layer, seed=2, experts=experts)
    _assert_close_to_float64_and_compiled_equal(exact, eager, compiled)


def test_gather_rows_backward_kernel_equals_float64_sum():
    n, k, d = 300, 8, 1000
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, d, generator=g).to(torch.bfloat16).cuda().requires_grad_()
    perm = torch.randperm(n * k, generator=g).cuda()
    inverse = inverse_permutation(perm)
    grad = torch.randn(n * k, d, generator=g).to(torch.bfloat16).cuda()
    gather_rows(x, perm // k, inverse, k).backward(grad)
    _assert_rounded_once(x.grad, grad.double().index_select(0, inverse).view(n, k, d).sum(1))


def test_rows_past_a_limit_are_neither_read_nor_written():
    """With a limit (expert parallelism's all-gather: only this rank's assignments exist) the combine, the token
    gather and their backwards touch only the rows below it. Rows past it hold NaN here, as unwritten buffers may:
    the results equal float64 references in which the slots past the limit are dropped, with no NaN anywhere, and
    the gradient rows past the limit are left unwritten (still the NaN they were allocated over)."""
    from models.qwen35_moe.kernels.moe_combine_triton import weighted_row_sum

    n, k, d = 300, 8, 2096
    src, index, weights, grad_out = _inputs(n, k, d, seed=4)
    rows = n * k * 3 // 8
    limit = torch.tensor(rows, device="cuda")
    src[rows:] = float("nan")
    here = (index < rows).view(n, k)
    src64 = src.double().nan_to_num(0).requires_grad_()
    w64 = weights.double().requires_grad_()
    exact = (src64[index].view(n, k, d) * (w64 * here)[..., None]).sum(1)
    exact.backward(grad_out.double())

    torch.testing.assert_close(weighted_row_sum(src, index, weights, torch.float32, limit).double(), exact.detach(),
                               rtol=1e-6, atol=1e-6)
    src_ = src.clone().requires_grad_()
    w_ = weights.clone().requires_grad_()
    weighted_row_sum(src_, index, w_, torch.bfloat16, limit).backward(grad_out)
    _assert_rounded_once(src_.grad[:rows], src64.grad[:rows], summed=False)
    torch.testing.assert_close(w_.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)  # zero past the limit
    assert (w_.grad[~here] == 0).all()

    # The gather feeding the experts: row i = x[index[i] // k] below the limit; its backward sums only those rows.
    x = torch.randn(n, d, device="cuda").to(torch.bfloat16).requires_grad_()
    inverse = inverse_permutation(index)
    taken = gather_rows(x, index // k, inverse, k, limit)
    assert torch.equal(taken[:rows], x.detach()[index[:rows] // k])
    grad = torch.randn(n * k, d, device="cuda").to(torch.bfloat16)
    grad[rows:] = float("nan")
    taken.backward(grad)
    _assert_rounded_once(x.grad, (grad.double().nan_to_num(0)).index_select(0, inverse).view(n, k, d).sum(1))


def test_layer_combine_with_a_limit_matches_the_torch_path_eager_and_compiled():
    """combine_expert_outputs with routed_rows (what the all-gather dispatch runs): on CUDA through the kernels,
    eager and compiled (fullgraph), against the float64 torch path, which masks the rows past the limit instead."""
    experts, running = 16, 6

    def layer(x, weights, ids, scale):
        counts = expert_counts(ids, experts)[:running]  # experts 0-5 run; the other slots add nothing
        run = lambda rows, counts: rows * scale  # noqa: E731
        return combine_expert_outputs(x, weights, ids, counts, run, out_dtype=torch.float32,
                                      routed_rows=counts.sum())

    exact, eager, compiled, ids = _layer_results(layer, seed=5, experts=experts)
    assert (exact[2][(ids >= running)] == 0).all() and (exact[2][(ids < running)] != 0).all()
    _assert_close_to_float64_and_compiled_equal(exact, eager, compiled)
