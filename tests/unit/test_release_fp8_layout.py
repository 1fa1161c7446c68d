"""scripts/make_release_checkpoint.py --fp8: a folder shaped like the Qwen/Qwen3.5-35B-A3B-FP8 release, checked
against a BF16 folder of the same seed and config: its quantization_config, which tensors are float8 with block
scales (a list written here from the release's layout), the others byte for byte the BF16 folder's, the float8 ones
that folder's weights quantized; and the full-size plan's size against the release's ~37 GB."""

from __future__ import annotations

import collections
import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models.qwen35_moe.fp8_blocks import quantize_blocks
from scripts.make_release_checkpoint import (
    SMALL_TEXT,
    SMALL_VISION,
    fp8_tensor_specs,
    fp8_weights,
    main,
    nbytes,
    plan_shards,
    random_weights,
    release_config,
    tensor_specs,
    write_weights,
)
from tests.unit.test_export_mtp_layout import headers
from tests.unit.test_fp8_blocks import per_element

# An expert's gate/up_proj of 160 x 64 and down_proj of 64 x 160: two blocks of 128 on a side, the second cut short,
# and the fused gate_up_proj's (320, 64) rows split at 160, inside a block, so each expert is quantized on its own.
TEXT = {**SMALL_TEXT, "moe_intermediate_size": 160}
SEED, SHARD_BYTES = 3, 2**16  # the small folders in ~20 shards: scales apart from their weights
# The release's quantized tensors: the projections of attention, the GDN, the shared expert and the routed experts
# (per expert, in the main layers and the MTP's), each `.weight` with its `.weight_scale_inv`.
QUANTIZED = re.compile(r"^(model\.language_model\.|mtp\.)layers\.\d+\.(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkv|"
                       r"in_proj_z|out_proj)|mlp\.shared_expert\.(gate|up|down)_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)"
                       r"\.weight$")
# The full-size release: 1811 BF16 tensors less the 80 fused expert tensors of the 40 main layers, plus their
# 40 x 256 x 3 per-expert weights; 250 quantized main-layer projections (30 GDN layers x 6, 10 attention layers x 7)
# and the MTP layer's 775 (4 attention, 3 shared expert, 768 experts): a scale for each quantized weight.
FULL_WEIGHTS, FULL_QUANTIZED = 1811 - 80 + 30_720, 30_720 + 250 + 775
FULL_BYTES = 37_454_799_072  # the release is ~37 GB, the BF16 one 71.9 GB


def _cli(folder: Path, *flags: str) -> Path:
    overrides = ["--text-config-overrides", json.dumps(TEXT), "--vision-config-overrides", json.dumps(SMALL_VISION)]
    assert main([str(folder), "--seed", str(SEED), "--max-shard-bytes", str(SHARD_BYTES), *overrides, *flags]) == 0
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("release_fp8")
    return {"bf16": _cli(root / "bf16"), "fp8": _cli(root / "fp8", "--fp8")}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for path in sorted(folder.glob("*.safetensors")) for k, v in load_file(path).items()}


def _kept(name: str, modules: list[str]) -> bool:
    return any(name == m or name.startswith(m + ".") for m in modules)


def _bf16_weight(name: str, bf16: dict[str, torch.Tensor]) -> torch.Tensor:
    """The BF16 folder's value of a weight of the FP8 layout: a main layer's expert is cut from the fused tensors,
    gate_proj = gate_up_proj[e, :I], up_proj = gate_up_proj[e, I:], down_proj = down_proj[e]."""
    expert = re.match(r"^(model\.language_model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
    if expert is None:
        return bf16[name]
    base, e, part = expert.group(1), int(expert.group(2)), expert.group(3)
    if part == "down":
        return bf16[f"{base}.down_proj"][e]
    gate_up = bf16[f"{base}.gate_up_proj"][e]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if part == "gate" else gate_up[half:]


def test_config_json_is_the_bf16_ones_with_the_releases_quantization_config(folders):
    bf16 = json.loads((folders["bf16"] / "config.json").read_text())
    fp8 = json.loads((folders["fp8"] / "config.json").read_text())
    quant = fp8.pop("quantization_config")
    assert fp8 == bf16
    modules = quant.pop("modules_to_not_convert")
    assert quant == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    text = bf16["text_config"]
    expected = ["lm_head", "model.language_model.embed_tokens", "mtp.fc", "mtp.layers.0.mlp.gate",
                "mtp.layers.0.mlp.shared_expert_gate", "model.visual"]
    for i, kind in enumerate(text["layer_types"]):
        layer = f"model.language_model.layers.{i}"
        expected += [f"{layer}.mlp.gate", f"{layer}.mlp.shared_expert_gate"]
        if kind == "linear_attention":
            expected += [f"{layer}.linear_attn.in_proj_a", f"{layer}.linear_attn.in_proj_b"]
    assert sorted(modules) == sorted(expected) and len(modules) == len(set(modules))


def test_each_quantized_weight_is_float8_with_bf16_block_scales_and_no_kept_module_is(folders):
    ours = headers(folders["fp8"])
    modules = json.loads((folders["fp8"] / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    fp8 = {k for k, (dtype, _) in ours.items() if dtype == "F8_E4M3"}
    assert fp8 == {k for k in ours if QUANTIZED.match(k)}
    assert not any(_kept(k.removesuffix(".weight"), modules) for k in fp8)
    for name in fp8:
        rows, cols = ours[name][1]
        assert ours[name + "_scale_inv"] == ("BF16", (math.ceil(rows / 128), math.ceil(cols / 128))), name
    assert {k for k in ours if k.endswith("_scale_inv")} == {k + "_scale_inv" for k in fp8}
    experts = {k for k in fp8 if ".mlp.experts." in k and k.startswith("model.language_model.")}
    assert len(experts) == 4 * 8 * 3 and not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in ours)
    assert ours["model.language_model.layers.0.mlp.experts.7.up_proj.weight_scale_inv"] == ("BF16", (2, 1))
    assert ours["model.language_model.layers.0.mlp.experts.7.down_proj.weight_scale_inv"] == ("BF16", (1, 2))


def test_the_unquantized_tensors_are_the_bf16_folders_byte_for_byte(folders):
    bf16, fp8 = _tensors(folders["bf16"]), _tensors(folders["fp8"])
    kept = {k: v for k, v in fp8.items() if v.dtype != torch.float8_e4m3fn and not k.endswith("_scale_inv")}
    assert any(k.startswith("model.visual.") for k in kept) and "lm_head.weight" in kept
    for name, value in kept.items():
        assert value.dtype == bf16[name].dtype and value.shape == bf16[name].shape, name
        assert torch.equal(value.view(torch.uint8), bf16[name].view(torch.uint8)), name
    # The rest of the BF16 folder is what was quantized: the same names, the main layers' experts fused there.
    fused = {k for k in bf16 if k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    quantized = {k for k, v in fp8.items() if v.dtype == torch.float8_e4m3fn}
    split = {k for k in quantized if k.startswith("model.language_model.") and ".mlp.experts." in k}
    assert bf16.keys() - kept.keys() == (quantized - split) | fused


def test_each_float8_weight_is_the_bf16_weight_quantized_within_e4m3s_rounding(folders):
    bf16, fp8 = _tensors(folders["bf16"]), _tensors(folders["fp8"])
    names = [k for k, v in fp8.items() if v.dtype == torch.float8_e4m3fn]
    assert len(names) == 4 * 8 * 3 + 3 * 6 + 7 + (8 * 3 + 7)
    for name in names:
        w, weight, scale = _bf16_weight(name, bf16), fp8[name], fp8[name + "_scale_inv"]
        # The writer's values are the BF16 folder's quantized: the same bytes as quantizing them here.
        expected, expected_scale = quantize_blocks(w, scale_dtype=torch.bfloat16)
        assert torch.equal(weight.view(torch.uint8), expected.view(torch.uint8)) and torch.equal(scale, expected_scale)
        # Dequantized (float64, each block's scale over its elements): e4m3 keeps 3 mantissa bits, so
        # round-to-nearest is within half a spacing, 2^-4 of |w|; below the least normal (2^-6) the spacing is
        # scale * 2^-9.
        scales = per_element(scale.double(), *weight.shape)
        deq, w = weight.double() * scales, w.double()
        assert ((deq - w).abs() <= w.abs() * 2.0**-4 + scales * 2.0**-9).all(), name


def test_each_bf16_tensor_is_drawn_once_and_each_weight_quantized_as_it_is_drawn(tmp_path):
    """Over many shards, every tensor of the BF16 layout is drawn once: a layer's fused experts once for all its
    experts, a weight's scales kept from its quantization rather than drawn again."""
    config = release_config(TEXT, SMALL_VISION)
    specs = tensor_specs(config)
    fp8_specs, pieces = fp8_tensor_specs(specs)
    make, drawn = random_weights(config, SEED, "cpu"), collections.Counter()

    def counted(name, spec):
        drawn[name] += 1
        return make(name, spec)

    write_weights(tmp_path, fp8_specs, fp8_weights(specs, pieces, counted), max_shard_bytes=2**14, log=lambda _: None)
    assert len(plan_shards(fp8_specs, 2**14)) > 20
    assert drawn.keys() == specs.keys() and set(drawn.values()) == {1}


def test_the_full_size_fp8_plan_is_about_the_releases_37_gb(tmp_path, capsys):
    specs, _ = fp8_tensor_specs(tensor_specs(release_config()))
    dtypes = collections.Counter(dtype for dtype, _ in specs.values())
    assert dtypes[torch.float8_e4m3fn] == FULL_QUANTIZED and len(specs) == FULL_WEIGHTS + FULL_QUANTIZED
    assert sum(k.endswith("_scale_inv") for k in specs) == FULL_QUANTIZED
    total = sum(map(nbytes, specs.values()))
    assert total == FULL_BYTES and 36e9 < total < 38e9
    assert len(plan_shards(specs)) == 7
    assert main([str(tmp_path / "new"), "--fp8", "--plan"]) == 0 and not (tmp_path / "new").exists()
    assert capsys.readouterr().out.splitlines()[-1] == f"{len(specs)} tensors, {FULL_BYTES:,} bytes"
