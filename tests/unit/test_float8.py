"""FP8 training (`[quantize]`, harness/float8.py) on a CPU, its GEMMs emulated by torchao: a converted projection's
forward and both gradients, and a routed expert layer's, against a float64 reference of the rowwise recipe written
here (the casts' power-of-two scales and e4m3 rounding); the token groups laid out for the FP8 grouped GEMM and back;
which modules a run converts, a run's losses beside the plain run's, a resume across the two modes, and every
refusal as one error line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao")

from harness.config import load_config  # noqa: E402
from harness.float8 import ALIGN, Float8ExpertGemms, Float8Gemm, aligned_groups, convert_to_float8  # noqa: E402
from harness.train import BAD_INPUT, main  # noqa: E402
from models.qwen35_moe import Qwen35MoeModel, get_flavor  # noqa: E402
from models.qwen35_moe.linear import Linear  # noqa: E402
from models.qwen35_moe.moe import RoutedExperts  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RUN = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false",
       "--metrics.log_freq", "1", "--training.dataset_path", str(REPO / "data" / "debug_corpus" / "train.jsonl")]
EMULATED = ["--quantize.linear_float8_recipe", "rowwise", "--quantize.grouped_mm_float8_fqns", "experts",
            "--quantize.float8_emulate", "true"]
E4M3 = torch.float8_e4m3fn


def cast(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t (float64) through float8 e4m3 and back: one scale per slice along `dim` (the GEMM's contraction), the
    largest power of two that keeps the slice's amax within 448 (the rowwise recipe's scales)."""
    fmax = torch.finfo(E4M3).max
    scale = torch.exp2(torch.floor(torch.log2(fmax / t.abs().amax(dim, keepdim=True).clamp(min=1e-12))))
    return (t * scale).clamp(-fmax, fmax).to(E4M3).double() / scale


def _gemm(recipe: str) -> Float8Gemm:
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return Float8Gemm(type(config)(**{**config.__dict__, "emulate": True}), 96, 48)


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_a_converted_gemm_is_the_recipes_float64_definition(recipe):
    """y = x W^T, dx = dy W and dW = dy^T x, each operand cast along the product's contraction (x and W per row for
    y; dy per row, W per column for dx; dy and x per column for dW, or no cast with _gw_hp), to fp32 accumulation
    (K = 96: measured within 1e-6 of the largest value)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, 96, generator=g, requires_grad=True)
    weight = (torch.randn(48, 96, generator=g) * 0.05).requires_grad_()
    bias = torch.randn(48, generator=g)
    dy = torch.randn(2, 40, 48, generator=g)
    out = _gemm(recipe)(x, weight, bias)
    out.backward(dy)
    x64, w64, dy64 = x.detach().double().reshape(-1, 96), weight.detach().double(), dy.double().reshape(-1, 48)
    expected = {"y": (cast(x64, -1) @ cast(w64, -1).t() + bias.double()).reshape(2, 40, 48),
                "dx": (cast(dy64, -1) @ cast(w64, 0)).reshape(2, 40, 96),
                "dW": dy64.t() @ x64 if recipe.endswith("gw_hp") else cast(dy64, 0).t() @ cast(x64, 0)}
    got = {"y": out.detach(), "dx": x.grad, "dW": weight.grad}
    for name, value in expected.items():
        assert (got[name].double() - value).abs().max() <= 1e-6 * value.abs().max(), name
    plain = x64 @ w64.t()  # and the casts are real: e4m3's rounding, far above fp32's
    assert (out.detach().double().reshape(-1, 48) - bias.double() - plain).abs().max() > 1e-3 * plain.abs().max()


def test_a_converted_expert_layer_is_the_recipes_float64_definition_per_expert():
    """The loop path (CPU) of routed experts with FP8 GEMMs: per expert, gate_up = x W1^T and out = h W2^T with x, h
    and each weight cast along the contraction, h = silu(gate) * up; the backward's casts as the dense recipe's
    (checked above) reach x and the weights of the experts with tokens, none of the one without."""
    g = torch.Generator().manual_seed(1)
    experts = RoutedExperts(num_experts=3, dim=64, hidden_dim=32)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(3, 64, 64, generator=g) * 0.1)
        experts.down_proj.copy_(torch.randn(3, 64, 32, generator=g) * 0.1)
    experts.gemms = Float8ExpertGemms(_gemm("rowwise").config, on_gpu=False)
    counts = torch.tensor([20, 0, 12])
    x = torch.randn(32, 64, generator=g, requires_grad=True)
    out = experts(x, counts)
    dy = torch.randn(32, 64, generator=g)
    out.backward(dy)
    expected = []
    for e, rows in zip((0, 2), (x[:20], x[20:])):
        w1, w2 = experts.gate_up_proj[e].detach().double(), experts.down_proj[e].detach().double()
        gate, up = (cast(rows.detach().double(), -1) @ cast(w1, -1).t()).chunk(2, dim=-1)
        hidden = torch.nn.functional.silu(gate) * up
        expected.append(cast(hidden, -1) @ cast(w2, -1).t())
    expected = torch.cat(expected)
    assert (out.detach().double() - expected).abs().max() <= 1e-6 * expected.abs().max()
    assert x.grad.abs().sum() > 0 and experts.gate_up_proj.grad[1].abs().sum() == 0


def test_aligned_groups_start_at_multiples_of_16_and_come_back_as_they_were():
    """The layout torchao's FP8 grouped GEMM needs: each expert's rows from a multiple of 16, zeros between (they
    raise no column's amax); a grouped GEMM on it, taken back, is the grouped GEMM on the rows as they came, values
    and gradients (rows past the last expert's, under expert parallelism, unspecified and not compared)."""
    g = torch.Generator().manual_seed(2)
    counts = torch.tensor([5, 0, 16, 17, 1])
    offsets = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()) + 3, 32, generator=g, requires_grad=True)
    weight = torch.randn(5, 48, 32, generator=g, requires_grad=True)
    padded, ends, restore = aligned_groups(x, offsets)
    assert padded.shape[0] == x.shape[0] + ALIGN * 5 and ends.tolist() == [16, 16, 32, 64, 80]
    starts = [0, 16, 16, 32, 64]
    for e, (start, n) in enumerate(zip(starts, counts.tolist())):
        first = int(offsets[e]) - n
        assert torch.equal(padded[start:start + n], x[first:first + n].detach())
        assert not padded[start + n:int(ends[e])].any()
    routed = int(counts.sum())
    ours = restore(torch._grouped_mm(padded, weight.transpose(-2, -1), offs=ends))[:routed]
    plain = torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)[:routed]
    dy = torch.randn_like(plain)
    grads = [torch.autograd.grad(y, (x, weight), dy) for y in (ours, plain)]
    (ours_dx, ours_dw), (plain_dx, plain_dw) = grads
    # fp32 sums in other orders (the GEMMs' blocking over other row counts): within 1e-5 of the largest value
    for a, b in ((ours, plain), (ours_dx[:routed], plain_dx[:routed]), (ours_dw, plain_dw)):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    assert ours_dw.abs().sum() > 0


def test_the_experts_grouped_path_lays_its_groups_out_and_back_as_the_loop_path_runs_them():
    """RoutedExperts' grouped path (the GPU's, run here on CPU tensors) with `gemms` aligning the groups and plain
    grouped GEMMs, and without `gemms`, against the loop path: the same outputs and gradients for the routed rows."""
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(3)
    experts = RoutedExperts(num_experts=4, dim=32, hidden_dim=16)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(4, 32, 32, generator=g))
        experts.down_proj.copy_(torch.randn(4, 32, 16, generator=g))
    counts = torch.tensor([7, 0, 20, 3])
    x = torch.randn(32, 32, generator=g)
    dy = torch.randn(30, 32, generator=g)
    plain_grouped = SimpleNamespace(aligned=aligned_groups, linear=torch.nn.functional.linear,
                                    grouped=lambda a, w, offs: torch._grouped_mm(a, w, offs=offs))
    results = {}
    for name, gemms, run in (("loop", None, experts._loop), ("grouped", None, experts._grouped_mm),
                             ("aligned", plain_grouped, experts._grouped_mm)):
        experts.gemms, experts.gate_up_proj.grad = gemms, None
        xi = x.clone().requires_grad_()
        out = run(xi, counts)[:30]
        out.backward(dy)
        results[name] = (out.detach(), xi.grad[:30], experts.gate_up_proj.grad.clone())
    for name in ("grouped", "aligned"):  # fp32 sums in other orders: within 1e-5 of the largest value
        for ours, loop in zip(results[name], results["loop"]):
            assert (ours - loop).abs().max() <= 1e-5 * loop.abs().max(), name


def test_the_blocks_projections_are_converted_and_the_rest_kept():
    """The default filter keeps the lm_head, shared_expert_gate, in_proj_a/b and the MTP layer's projections; a
    projection whose sizes are not multiples of 16 stays too; grouped_mm_float8_fqns "experts" takes every routed
    expert layer, the MTP's too."""
    args = get_flavor("debugmodel_mtp")
    with torch.device("meta"):
        model = Qwen35MoeModel(args)
    model.layers["0"].linear_attn.out_proj = Linear(args.linear_num_value_heads * args.linear_value_head_dim, 72,
                                                  bias=False, device="meta")
    cfg = load_config(EMULATED)
    converted = set(convert_to_float8(model, cfg, torch.device("cpu")))
    experts = {name for name, m in model.named_modules() if isinstance(m, RoutedExperts)}
    assert experts and experts <= converted and all(model.get_submodule(n).gemms is not None for n in experts)
    converted -= experts
    linears = {name for name, m in model.named_modules() if isinstance(m, Linear)}
    assert all((model.get_submodule(n).gemm is not None) == (n in converted) for n in linears)
    kept = {n for n in linears - converted if n != "layers.0.linear_attn.out_proj"}
    assert kept and all(any(s in n for s in ("lm_head", "shared_expert_gate", "in_proj_a", "in_proj_b", "mtp."))
                        for n in kept)
    assert {"layers.0.linear_attn.in_proj_qkv", "layers.1.self_attn.q_proj", "layers.1.mlp.shared_expert.down_proj"} \
        <= converted and "layers.0.linear_attn.out_proj" not in converted


def _losses(dump: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_an_fp8_run_follows_the_plain_run_and_resumes_without_it(tmp_path):
    """From the same weights and rows the FP8 run's losses stay within 0.5% of the plain run's over 12 steps
    (measured 0.16%, the routed experts converted too); its checkpoint holds the same tensors, so the plain mode resumes it."""
    runs = {}
    for name, flags in (("fp8", EMULATED), ("plain", [])):
        dump = tmp_path / name
        assert main([*RUN, *flags, "--training.steps", "12", "--job.dump_folder", str(dump)]) == 0
        runs[name] = _losses(dump)
    gaps = [abs(a - b) / b for a, b in zip(runs["fp8"], runs["plain"], strict=True)]
    assert max(gaps) < 5e-3 and runs["fp8"] != runs["plain"]
    dump = tmp_path / "switch"
    assert main([*RUN, *EMULATED, "--training.steps", "4", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
                 "--job.dump_folder", str(dump)]) == 0
    assert main([*RUN, "--training.steps", "6", "--checkpoint.enable", "true", "--job.dump_folder", str(dump)]) == 0
    assert len(_losses(dump)) == 6


def _error(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1
    return lines[0]


def test_an_fp8_run_it_cannot_make_is_one_error_line(tmp_path, capsys, monkeypatch):
    """On a CPU without emulation, with LoRA, and without torchao: exit 2, one line naming the way out."""
    flags = [*RUN, "--training.steps", "1", "--quantize.linear_float8_recipe", "rowwise"]
    assert main([*flags, "--job.dump_folder", str(tmp_path / "cpu")]) == BAD_INPUT
    assert "quantize.linear_float8_recipe needs a GPU with FP8 tensor cores" in _error(capsys)
    both = [*flags, "--quantize.grouped_mm_float8_fqns", "experts", "--job.dump_folder", str(tmp_path / "both")]
    assert main(both) == BAD_INPUT
    assert "quantize.linear_float8_recipe and quantize.grouped_mm_float8_fqns need a GPU" in _error(capsys)
    assert main([*flags, "--lora.enable", "true", "--job.dump_folder", str(tmp_path / "lora")]) == BAD_INPUT
    assert "set quantize.linear_float8_recipe none and quantize.grouped_mm_float8_fqns [] for LoRA" in _error(capsys)
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a))
    assert main([*flags, "--quantize.float8_emulate", "true", "--job.dump_folder", str(tmp_path / "none")]) \
        == BAD_INPUT
    assert "needs torchao, which is not installed: pip install -e '.[fp8]'" in _error(capsys)


def test_fp8_settings_that_convert_nothing_are_one_error_line_naming_both(tmp_path, capsys):
    """A filter that keeps every projection in bf16 and expert names that match no routed experts' module (a slip
    such as 'mlp.expert.' for 'mlp.experts'): exit 2 before anything trains, both named in one line, with the
    experts' module names to choose from."""
    flags = [*RUN, "--training.steps", "1", "--quantize.linear_float8_recipe", "rowwise", "--quantize.float8_emulate",
             "true", "--quantize.linear_float8_filter_fqns", "layers.,lm_head", "--quantize.grouped_mm_float8_fqns",
             "mlp.expert.", "--job.dump_folder", str(tmp_path / "run")]
    assert main(flags) == BAD_INPUT
    error = _error(capsys)
    assert "quantize.linear_float8_recipe 'rowwise' converts no projection" in error, error
    assert "quantize.grouped_mm_float8_fqns ['mlp.expert.'] names none of the routed experts' modules " \
           "(layers.N.mlp.experts; " in error, error
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
