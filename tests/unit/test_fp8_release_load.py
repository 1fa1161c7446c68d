"""An official FP8 release folder as the weights a run starts from (checkpoint.initial_load_hf): its config's
quantization_config checked field by field, its tensors checked against the layout, its float8 weights read
dequantized (models/qwen35_moe/fp8_release.py) to exactly the format's definition, the model's logits those of
transformers' own reading of the folder; a full fine-tune and a LoRA run start from it; anything else is one error
line and exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.checkpoint.hf_weights import export_hf, hf_native_tensors
from harness.train import BAD_INPUT, main
from models.qwen35_moe import get_flavor
from models.qwen35_moe.hf_checkpoint import from_pretrained
from tests.builders import fp8_reference, fp8_release_folder, initialized_model

REPO = Path(__file__).resolve().parents[2]
FAST = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false",
        "--training.steps", "2", "--training.dataset_path", str(REPO / "data" / "debug_corpus" / "train.jsonl")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    flavor = get_flavor("debugmodel")
    export_hf(initialized_model(flavor, 0), flavor, str(root / "fp32"), torch.float32)
    return {"fp32": root / "fp32", "fp8": fp8_release_folder(root / "fp32", root / "fp8"),
            "fp8_bf16_scales": fp8_release_folder(root / "fp32", root / "fp8b", torch.bfloat16)}


def _stored(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("which", ["fp8", "fp8_bf16_scales"])
def test_each_float8_weight_reads_as_value_times_its_blocks_scale(folders, which):
    """Every quantized weight, fused into the model's expert layout, equals the float64 definition rounded once to
    fp32 (an e4m3 value has 4 significant bits: times a bf16 scale the product is exact in fp32; times an fp32 scale
    IEEE multiplication rounds the exact product once, as the cast of the float64 product does)."""
    stored = _stored(folders[which])
    quantized = [k for k, v in stored.items() if v.dtype == torch.float8_e4m3fn]
    assert len(quantized) > 20 and all(k + "_scale_inv" in stored for k in quantized)
    shapes, read = hf_native_tensors(folders[which], get_flavor("debugmodel"))
    assert not any(k.endswith("_scale_inv") for k in shapes)
    q_proj = "layers.1.self_attn.q_proj.weight"  # the debug model's full-attention layer
    reference = fp8_reference(stored[f"model.{q_proj}"], stored[f"model.{q_proj}_scale_inv"])
    assert read(q_proj).dtype == torch.float32 and torch.equal(read(q_proj), reference.float())
    gate_up = read("layers.0.mlp.experts.gate_up_proj")  # (E, 2I, D): per expert cat(gate, up)
    # read in the compute dtype (as a run loads): each part cast before the fusing, the same numbers
    assert torch.equal(read("layers.0.mlp.experts.gate_up_proj", torch.bfloat16), gate_up.bfloat16())
    for e in range(gate_up.shape[0]):
        for half, name in enumerate(("gate_proj", "up_proj")):
            key = f"model.layers.0.mlp.experts.{e}.{name}.weight"
            rows = gate_up.shape[1] // 2
            assert torch.equal(gate_up[e, half * rows:(half + 1) * rows], fp8_reference(
                stored[key], stored[key + "_scale_inv"]).float())
    router = read("layers.0.mlp.gate.weight")  # kept unquantized: as stored
    assert torch.equal(router, stored["model.layers.0.mlp.gate.weight"])


def test_the_models_logits_are_those_of_transformers_reading_the_fp8_folder(folders):
    """transformers' fine-grained FP8 integration dequantizes the folder on a CPU (into fp32 here); our model
    from the same folder gives its logits to fp32 rounding of two implementations (measured 1.8e-7)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folders["fp8"], dtype=torch.float32).eval()
    ours = from_pretrained(folders["fp8"], dtype=torch.float32).eval()
    ids = torch.randint(0, get_flavor("debugmodel").vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, mine = hf(input_ids=ids).logits, ours(ids).logits
    assert (theirs - mine).abs().max() < 1e-5 * theirs.abs().max()
    # and the quantization is real: the fp32 folder's logits differ by e4m3's rounding
    with torch.no_grad():
        full = from_pretrained(folders["fp32"], dtype=torch.float32).eval()(ids).logits
    assert (full - mine).abs().max() > 1e-3 * full.abs().max()


def test_a_full_fine_tune_and_a_lora_run_start_from_an_fp8_release(folders, tmp_path, capsys):
    """The full fine-tune dequantizes (and says so); LoRA's merged export carries an unadapted quantized weight
    dequantized exactly (export dtype fp32)."""
    assert main([*FAST, "--checkpoint.initial_load_hf", str(folders["fp8"]), "--job.dump_folder",
                 str(tmp_path / "full")]) == 0
    assert "is an FP8 release" in capsys.readouterr().err
    assert main([*FAST, "--checkpoint.initial_load_hf", str(folders["fp8"]), "--lora.enable", "true",
                 "--lora.targets", "q_proj,v_proj", "--checkpoint.export_hf_at_end", "true",
                 "--checkpoint.export_dtype", "float32", "--job.dump_folder", str(tmp_path / "lora")]) == 0
    stored, exported = _stored(folders["fp8"]), {}
    for shard in (tmp_path / "lora" / "hf").glob("*.safetensors"):
        exported.update(load_file(shard))
    key = "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert torch.equal(exported[key], fp8_reference(stored[key], stored[key + "_scale_inv"]).float())


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("field, value, named", [
    ("fmt", "e5m2", "quantization_config.fmt 'e5m2' is not supported"),
    ("weight_block_size", [64, 64], "quantization_config.weight_block_size [64, 64] is not supported"),
    ("activation_scheme", "static", "quantization_config.activation_scheme 'static' is not supported"),
    ("scale_fmt", "ue8m0", "quantization_config.scale_fmt 'ue8m0' is not supported"),
    ("quant_method", "awq", "quantization_config.quant_method 'awq' is not supported"),
    ("group_size", 128, "fields this project does not read: group_size"),
])
def test_an_unsupported_quantization_config_is_refused_before_anything_runs(folders, tmp_path, capsys, field, value,
                                                                            named):
    folder = tmp_path / "release"
    shutil.copytree(folders["fp8"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"][field] = value
    (folder / "config.json").write_text(json.dumps(config))
    assert main([*FAST, "--checkpoint.initial_load_hf", str(folder), "--job.dump_folder",
                 str(tmp_path / "run")]) == BAD_INPUT
    assert named in _error_line(capsys)
    assert not (tmp_path / "run").exists()


def _damaged(folders, tmp_path, damage) -> Path:
    folder = tmp_path / "release"
    shutil.copytree(folders["fp8"], folder)
    tensors = _stored(folder)
    damage(tensors, folder)
    save_file(tensors, folder / "model.safetensors")
    return folder


def _drop_quantization_config(tensors, folder):
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))


def _set(tensors, key, index, value):
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[index] = value


def _set_byte(tensors, key, index, byte):
    """A float8 weight with one stored byte replaced."""
    raw = tensors[key].view(torch.uint8).clone()
    raw.view(-1)[index] = byte
    tensors[key] = raw.view(torch.float8_e4m3fn)


@pytest.mark.parametrize("damage, named", [
    (lambda t, f: t.pop("model.layers.0.linear_attn.out_proj.weight_scale_inv"),
     "model.layers.0.linear_attn.out_proj.weight is float8 without its"),
    (lambda t, f: t.update({"model.layers.1.self_attn.o_proj.weight_scale_inv": torch.ones(3, 3)}),
     "model.layers.1.self_attn.o_proj.weight_scale_inv has shape (3, 3)"),
    (lambda t, f: t.update({"model.layers.0.mlp.gate.weight": t["model.layers.0.mlp.gate.weight"].to(
        torch.float8_e4m3fn), "model.layers.0.mlp.gate.weight_scale_inv": torch.ones(1, 1)}),
     "model.layers.0.mlp.gate.weight is float8 but quantization_config.modules_to_not_convert keeps"),
    (_drop_quantization_config, "holds float8 tensors but its config.json has no quantization_config"),
    (lambda t, f: _set(t, "model.layers.0.linear_attn.out_proj.weight_scale_inv", 0, float("inf")),
     "1 weight holds NaN or infinite values (layers.0.linear_attn.out_proj.weight)"),
    (lambda t, f: _set_byte(t, "model.layers.0.mlp.experts.5.up_proj.weight", 7, 0xFF),  # e4m3fn's -NaN
     "1 weight holds NaN or infinite values (layers.0.mlp.experts.gate_up_proj)"),
])
def test_a_folder_that_breaks_the_fp8_layout_is_one_error_line(folders, tmp_path, capsys, damage, named):
    folder = _damaged(folders, tmp_path, damage)
    assert main([*FAST, "--checkpoint.initial_load_hf", str(folder), "--job.dump_folder",
                 str(tmp_path / "run")]) == BAD_INPUT
    assert named in _error_line(capsys)


def test_the_reader_opens_each_file_once_however_many_tensors_it_reads(folders, monkeypatch):
    """An FP8 release stores the routed experts per expert (64k tensors at full size) and each opening of a
    safetensors file parses its whole header: the reader keeps each file open, so reading every tensor parses each
    header once (per read it took 0.17 s, hours for the full-size load)."""
    import models.qwen35_moe.hf_checkpoint as hf_checkpoint

    opened = []
    real = hf_checkpoint.safe_open
    monkeypatch.setattr(hf_checkpoint, "safe_open", lambda path, **kw: opened.append(path) or real(path, **kw))
    shapes, read = hf_native_tensors(folders["fp8"], get_flavor("debugmodel"))
    for key in shapes:
        read(key)
    assert opened == [str(folders["fp8"] / "model.safetensors")]


def test_modules_kept_unquantized_are_fnmatchs_module_patterns():
    """kept_unquantized looks plain module names up among the key's dot prefixes; its answer must stay the fnmatch
    definition (the key matches m or m.*) for names and wildcard patterns alike, on keys and lists drawn at random
    from parts that make prefixes, empty parts and wildcards meet."""
    import random
    from fnmatch import fnmatchcase

    from models.qwen35_moe.fp8_config import kept_unquantized

    rng = random.Random(0)
    parts, pattern_parts = ["a", "b", "ab", "", "mlp", "0"], ["a", "b", "ab", "", "mlp", "0", "*", "?", "[ab]"]
    for _ in range(5000):
        key = ".".join(rng.choice(parts) for _ in range(rng.randrange(1, 5)))
        modules = [".".join(rng.choice(pattern_parts) for _ in range(rng.randrange(1, 4)))
                   for _ in range(rng.randrange(4))]
        expected = any(fnmatchcase(key, m) or fnmatchcase(key, m + ".*") for m in modules)
        assert kept_unquantized(key, modules) == expected, (key, modules)
    assert kept_unquantized("model.layers.0.mlp.gate.weight", ["model.layers.0.mlp.gate"])
    assert not kept_unquantized("model.layers.0.mlp.gate_proj.weight", ["model.layers.0.mlp.gate"])
    assert not kept_unquantized("x.weight", None)
