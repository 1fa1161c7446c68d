"""FP8 training's GEMMs on the GPU's FP8 tensor cores (harness/float8.py, torchao's rowwise recipe): a converted
projection's forward and gradients in bf16 against the same casts with the GEMMs emulated in fp32 (the CPU tests'
path, itself held to a float64 reference in tests/unit/test_float8.py); the routed experts' FP8 grouped GEMM on
token groups aligned to 16 rows against the emulated per-expert loop of the CPU path; and a compiled debug run against
the bf16 run from the same weights and rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a GPU with FP8 tensor cores")

from harness.float8 import Float8ExpertGemms, Float8Gemm  # noqa: E402
from harness.train import main  # noqa: E402
from models.qwen35_moe.moe import RoutedExperts  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _gemm(emulate: bool) -> Float8Gemm:
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name("rowwise")
    return Float8Gemm(type(config)(**{**config.__dict__, "emulate": emulate}), 256, 512)


def test_the_fp8_gemms_are_the_emulated_ones():
    """Both paths cast the same operands to the same float8 values; they differ in the GEMMs' accumulation and in
    bf16's rounding of the outputs (2^-8 relative)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, 128, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    weight = torch.randn(512, 256, device="cuda", generator=g, dtype=torch.bfloat16) * 0.05
    dy = torch.randn(4, 128, 512, device="cuda", generator=g, dtype=torch.bfloat16)
    results = {}
    for emulate in (False, True):
        xi, wi = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = _gemm(emulate)(xi, wi)
        out.backward(dy)
        results[emulate] = (out.float(), xi.grad.float(), wi.grad.float())
    for fast, slow in zip(results[False], results[True]):
        assert (fast - slow).abs().max() <= 2**-7 * slow.abs().max()


def test_the_experts_fp8_grouped_gemm_is_the_emulated_per_expert_loop():
    """bf16 experts on the GPU (torchao's grouped GEMM, groups of 0 to 300 tokens laid out at multiples of 16)
    against the same weights and tokens in fp32 on the CPU's loop path, emulated: the same casts of x and the
    weights; the hidden h = silu(gate) * up is rounded to bf16 on the GPU only, so its casts may differ by an e4m3
    step here and there (relative L2 error bound 2%)."""
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([300, 0, 17, 128, 1, 64, 200, 33])
    weights = (torch.randn(8, 1024, 512, generator=g) * 0.05, torch.randn(8, 512, 512, generator=g) * 0.05)
    x = torch.randn(int(counts.sum()), 512, generator=g).bfloat16()
    dy = torch.randn(int(counts.sum()), 512, generator=g).bfloat16()
    results = {}
    for device, dtype, emulate in (("cuda", torch.bfloat16, False), ("cpu", torch.float32, True)):
        experts = RoutedExperts(num_experts=8, dim=512, hidden_dim=512).to(device, dtype)
        with torch.no_grad():
            experts.gate_up_proj.copy_(weights[0].to(dtype))
            experts.down_proj.copy_(weights[1].to(dtype))
        experts.gemms = Float8ExpertGemms(_gemm(emulate).config, on_gpu=device == "cuda")
        xi = x.to(device, dtype).requires_grad_()
        out = experts(xi, counts.to(device))
        out.backward(dy.to(device, dtype))
        results[device] = [t.detach().float().cpu() for t in (out, xi.grad, experts.gate_up_proj.grad,
                                                              experts.down_proj.grad)]
    for fast, slow in zip(results["cuda"], results["cpu"]):
        assert (fast - slow).norm() <= 0.02 * slow.norm()


def test_a_compiled_fp8_run_follows_the_bf16_run(tmp_path):
    """The debug model compiled, its projections and routed experts in FP8 under full AC, 30 steps from the same
    weights and rows as a bf16 run without AC: the losses within 1% of bf16's from step 10 on. Full AC is the case
    where inductor recomputes the MoE half inside the compiled backward, the casts included (with rowwise scales a
    recompute that rounds differently from the forward is known to break runs: pytorch/pytorch#150859)."""
    flags = ["--training.seq_len", "256", "--training.local_batch_size", "4", "--training.steps", "30",
             "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--compile.enable", "true",
             "--training.dataset_path", str(REPO / "data" / "debug_corpus" / "train.jsonl")]
    losses = {}
    for name, extra in (("bf16", []), ("fp8", ["--quantize.linear_float8_recipe", "rowwise",
                                               "--quantize.grouped_mm_float8_fqns", "experts",
                                               "--activation_checkpoint.mode", "full"])):
        assert main([*flags, *extra, "--job.dump_folder", str(tmp_path / name)]) == 0
        rows = map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
        losses[name] = [r["loss"] for r in rows if "loss" in r]
    gaps = [abs(a - b) / b for a, b in zip(losses["fp8"][9:], losses["bf16"][9:], strict=True)]
    assert max(gaps) < 0.01, gaps
