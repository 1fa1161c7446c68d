"""The export re-quantized into the FP8 release's layout (checkpoint.export_quantized "fp8", the converter's
--quantized fp8): each tensor against an FP8 folder written from the bf16 export by another hand (tests/builders.py,
float64 block quantization), its names, dtypes and shapes against scripts/make_release_checkpoint.py --fp8's release
layout, transformers' fine-grained FP8 reading it, and the converter writing the same bytes as the end of a run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from harness.checkpoint.hf_weights import export_hf
from harness.convert import main as convert_main
from harness.train import main as train_main
from models.qwen35_moe import from_pretrained, get_flavor
from models.qwen35_moe.fp8_config import kept_unquantized
from scripts.make_release_checkpoint import RELEASE_TEXT_CONFIG, fp8_tensor_specs, release_config, tensor_specs
from tests.builders import fp8_release_folder, initialized_model
from tests.unit.test_convert_output_folder import files_under
from tests.unit.test_export_mtp_layout import headers
from tests.unit.test_lora_export import ARGS, FEW, LORA, SMALL_SHARDS, ids, lora_exports, lora_model, lora_step

REPO = Path(__file__).resolve().parents[2]
# a run that exports FP8 at its end, and a LoRA run of it that holds an FP8 base in FP8 (one process, full AC)
FP8_EXPORT_RUN = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.enable_tensorboard",
                  "false", "--training.steps", "2", "--checkpoint.export_hf_at_end", "true",
                  "--checkpoint.export_quantized", "fp8", "--checkpoint.export_dtype", "bfloat16",
                  "--training.dataset_path", str(REPO / "data" / "debug_corpus" / "train.jsonl")]
HELD_RUN = [*FP8_EXPORT_RUN, "--lora.enable", "true", "--lora.targets", "q_proj,v_proj",
            "--activation_checkpoint.mode", "full"]
SAFETENSORS_NAMES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in folder.glob("*.safetensors"):
        out.update(load_file(shard))
    return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A LoRA model (every target, the MTP layer's too) exported merged in fp32 and bf16 and re-quantized in FP8
    (export dtype bf16), and the FP8 folder tests/builders.py writes from the fp32 one."""
    folder = tmp_path_factory.mktemp("fp8_export")
    model = lora_model().float()
    lora_exports(model, LORA, folder / "fp32", None, torch.float32)
    lora_exports(model, LORA, folder / "bf16", None, torch.bfloat16)
    lora_exports(model, LORA, folder / "fp8", None, torch.bfloat16, quantized="fp8", max_shard_bytes=SMALL_SHARDS)
    return SimpleNamespace(model=model, bf16=folder / "bf16", fp8=folder / "fp8",
                           reference=fp8_release_folder(folder / "fp32", folder / "reference", torch.bfloat16))


def test_each_weight_is_quantized_from_its_fp32_merge_by_the_formats_definition(exports):
    """The reference folder's keys; its float8 bits and bf16 scales (the merged W + s B A in fp32, quantized there in
    float64 and here in fp32: both round the same quotient to e4m3), and the bf16 export's other tensors."""
    ours, reference, bf16 = _tensors(exports.fp8), _tensors(exports.reference), _tensors(exports.bf16)
    assert ours.keys() == reference.keys()
    quantized = [k for k, v in ours.items() if v.dtype == torch.float8_e4m3fn]
    assert len(quantized) > 40 and any(".mlp.experts.7.down_proj" in k for k in quantized)
    for key, value in ours.items():
        expected = reference[key] if key in quantized or key.endswith("_scale_inv") else bf16[key]
        assert value.dtype == expected.dtype and value.shape == expected.shape, key
        assert torch.equal(value.view(torch.uint8) if value.dtype == torch.float8_e4m3fn else value,
                           expected.view(torch.uint8) if value.dtype == torch.float8_e4m3fn else expected), key
    config = json.loads((exports.fp8 / "config.json").read_text())["quantization_config"]
    kept = json.loads((exports.reference / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    for key in ours:  # the same modules kept unquantized, however the two lists name them
        assert kept_unquantized(key, config["modules_to_not_convert"]) == kept_unquantized(key, kept), key
    assert {k: v for k, v in config.items() if k != "modules_to_not_convert"} == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert len(list(exports.fp8.glob("*.safetensors"))) > 1  # scales in other shards than their weights


def test_the_layout_is_the_release_layout_of_the_script_in_our_text_only_names(exports):
    """make_release_checkpoint.py --fp8's tensors for the same shapes, the text model under `model.` instead of
    `model.language_model.`, no vision tower, and dt_bias in F32 (docs/design.md: the export's one dtype change)."""
    text = {k: v for k, v in ARGS.to_hf_config("bfloat16").items() if k in RELEASE_TEXT_CONFIG or k == "layer_types"}
    release, _ = fp8_tensor_specs(tensor_specs(release_config(text)))
    expected = {}
    for name, (dtype, shape) in release.items():
        if not name.startswith("model.visual."):
            dtype = torch.float32 if name.endswith("linear_attn.dt_bias") else dtype
            expected[name.replace("model.language_model.", "model.", 1)] = (SAFETENSORS_NAMES[dtype], shape)
    assert headers(exports.fp8) == expected


def test_transformers_reads_the_fp8_export_as_we_do_and_near_the_bf16_one(exports):
    """transformers' fine-grained FP8 integration dequantizes the folder on a CPU; its logits are our model's from
    the same folder (fp32 rounding of two implementations, as tests/unit/test_fp8_release_load.py measures), and they
    differ from the bf16 export's by e4m3's rounding of the weights (3 mantissa bits: up to 6.25% of a weight):
    nonzero, and bounded (relative L2 error measured 6.3% on this random debug model)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(exports.fp8, dtype=torch.float32).eval()
    ours = from_pretrained(exports.fp8, dtype=torch.float32).eval()
    unquantized = from_pretrained(exports.bf16, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs, mine, bf16 = hf(input_ids=ids()).logits, ours(ids()).logits, unquantized(ids()).logits
    assert (theirs - mine).abs().max() < 1e-5 * theirs.abs().max()
    error = ((mine - bf16).norm() / bf16.norm()).item()
    assert 1e-3 < error < 0.1, error


def test_the_converter_writes_the_fp8_export_of_the_end_of_a_run(exports, tmp_path, capsys):
    """--quantized fp8 from a LoRA step (adapters + the base folder): the bytes the end of the run writes with
    checkpoint.export_quantized fp8; an unknown value is one error line."""
    base = exports.bf16  # any HF folder of the model: the base the adapters are merged into
    model = lora_model(seed=2, lora=FEW).float()
    model.load_state_dict(from_pretrained(base, dtype=torch.float32).state_dict(), strict=False)
    lora_exports(model, FEW, tmp_path / "run" / "hf", base, torch.bfloat16, quantized="fp8")
    step = lora_step(tmp_path / "run" / "checkpoint" / "step-20", model, base, FEW)
    assert convert_main([str(step), str(tmp_path / "out"), "--quantized", "fp8"]) == 0
    assert files_under(tmp_path / "out") == files_under(tmp_path / "run" / "hf")
    assert convert_main([str(step), str(tmp_path / "bad"), "--quantized", "int4"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == ["error: --quantized 'int4' is not one of none, fp8"]


def test_a_lora_run_from_an_fp8_release_gives_back_the_weights_it_did_not_adapt_bit_for_bit(tmp_path):
    """checkpoint.export_quantized fp8 at the end of a LoRA run on an FP8 release held in FP8 (export dtype bf16):
    every quantized weight outside the adapted modules is the release's float8 bits and scales (its blocks' largest
    value is 448, so the quantization finds them again); an adapted one is not."""
    flavor = get_flavor("debugmodel")
    export_hf(initialized_model(flavor, 3), flavor, str(tmp_path / "fp32"), torch.float32)
    release = fp8_release_folder(tmp_path / "fp32", tmp_path / "fp8", torch.bfloat16)
    assert train_main([*HELD_RUN, "--checkpoint.initial_load_hf", str(release),
                       "--job.dump_folder", str(tmp_path / "run")]) == 0
    stored, exported = _tensors(release), _tensors(tmp_path / "run" / "hf")
    assert exported.keys() == stored.keys()
    quantized = [k for k, v in stored.items() if v.dtype == torch.float8_e4m3fn]
    adapted = {k for k in quantized if ".q_proj." in k or ".v_proj." in k}
    for key in quantized:
        scale = key + "_scale_inv"
        unchanged = (torch.equal(exported[key].view(torch.uint8), stored[key].view(torch.uint8))
                     and torch.equal(exported[scale], stored[scale]))
        assert unchanged == (key not in adapted), key
    assert len(quantized) - len(adapted) > 20 and adapted


def test_the_accuracy_benchmarks_in_place_requantization_is_the_fp8_export_read_back(exports, tmp_path):
    """benchmarks/fp8_export_error.py measures the FP8 export's error without writing it: its weights, quantized in
    place in the model loaded from the fp32 merged export, are those of the FP8 export (fp32) read back."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from fp8_export_error import quantized_weights, requantize

    lora_exports(exports.model, LORA, tmp_path / "fp8", None, torch.float32, quantized="fp8")
    model = from_pretrained(exports.reference.parent / "fp32", dtype=torch.float32)
    weights = quantized_weights(model, ARGS)
    for weight, parts in weights.values():
        requantize(weight, parts)
    ours, exported = model.state_dict(), from_pretrained(tmp_path / "fp8", dtype=torch.float32).state_dict()
    assert len(weights) > 20 and ours.keys() == exported.keys()
    assert all(torch.equal(ours[k], exported[k]) for k in ours)


def test_a_full_fine_tune_exports_fp8_at_its_end_and_through_the_converter(tmp_path):
    """Without LoRA: the end of the run writes the FP8 layout (the script's release layout, checked from the headers
    by benchmarks/tools/fp8_layout_check.py), our loader reads it back as an FP8 release, and the converter writes the
    same bytes from the run's last checkpoint."""
    dump = tmp_path / "run"
    assert train_main([*FP8_EXPORT_RUN, "--model.flavor", "debugmodel_mtp", "--checkpoint.enable", "true",
                       "--job.dump_folder", str(dump)]) == 0
    checked = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tools" / "fp8_layout_check.py"),
                              str(dump / "hf")], capture_output=True, text=True)
    assert checked.returncode == 0 and " 0 differ; quantization_config as the release" in checked.stdout
    model = from_pretrained(dump / "hf", dtype=torch.float32)  # through fp8_release.py's checks
    assert model.mtp is not None
    assert convert_main([str(dump / "checkpoint" / "step-2"), str(tmp_path / "out"), "--quantized", "fp8"]) == 0
    assert files_under(tmp_path / "out") == files_under(dump / "hf")
