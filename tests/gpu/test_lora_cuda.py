"""LoRA on the GPU: the routed experts' adapters as grouped GEMMs (bf16) against the per-expert loop in fp32 on the
same weights, and a LoRA run through the trainer as a user runs it (bf16 frozen base, compiled, full activation
checkpointing) following the eager run, its base held in bf16 and only the adapters trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.checkpoint.hf_weights import export_hf, hf_native_tensors
from harness.train import main
from models.qwen35_moe import get_flavor
from models.qwen35_moe.lora import ExpertLowRank
from models.qwen35_moe.lora_targets import LoraArgs
from models.qwen35_moe.moe import RoutedExperts
from tests.builders import fp8_release_folder, initialized_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
REPO = Path(__file__).resolve().parents[2]


def test_expert_adapters_in_grouped_gemms_match_the_fp32_loop():
    torch.manual_seed(0)
    experts, dim, hidden, rank = 8, 256, 128, 16
    module = RoutedExperts(experts, dim, hidden).cuda()
    module.adapter = ExpertLowRank(experts, dim, hidden, LoraArgs(rank=rank, alpha=32.0)).cuda()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.05)
    counts = torch.tensor([40, 0, 17, 64, 3, 90, 0, 42], device="cuda")
    x = torch.randn(int(counts.sum()) + 8, dim, device="cuda")  # 8 rows past the last expert's
    reference = module._loop(x, counts)  # fp32 on CUDA: the loop path
    out = module(x.bfloat16(), counts)  # bf16 on CUDA: the grouped GEMMs
    routed = int(counts.sum())
    # bf16 inputs and weights, fp32 accumulation: ~3 significant digits
    torch.testing.assert_close(out[:routed].float(), reference[:routed], rtol=2e-2, atol=2e-2)
    without = RoutedExperts(experts, dim, hidden).cuda()
    without.load_state_dict({k: v for k, v in module.state_dict().items() if ".adapter." not in k and
                             not k.startswith("adapter.")})
    assert (without(x.bfloat16(), counts)[:routed].float() - out[:routed].float()).abs().max() > 0.1  # it adds


def _run(folder: Path, *flags: str) -> list[dict]:
    torch._dynamo.reset()
    assert main(["--config", str(REPO / "train_configs" / "debug_model.toml"), "--lora.enable", "true",
                 "--lora.targets", "q_proj,k_proj,v_proj,o_proj,in_proj_qkv,in_proj_z,out_proj,shared_expert,experts",
                 "--optimizer.lr", "1e-2", "--training.steps", "6", "--metrics.log_freq", "1",
                 "--metrics.enable_tensorboard", "false", "--checkpoint.export_hf_at_end", "false",
                 "--job.dump_folder", str(folder), *flags]) == 0
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def test_compiled_checkpointed_lora_training_follows_the_eager_run(tmp_path):
    eager = _run(tmp_path / "eager", "--compile.enable", "false", "--activation_checkpoint.mode", "none")
    compiled = _run(tmp_path / "compiled", "--compile.enable", "true", "--activation_checkpoint.mode", "full")
    for e, c in zip(eager, compiled):
        assert c["loss"] == pytest.approx(e["loss"], rel=5e-3)  # bf16: compiled graphs round differently
    assert eager[-1]["loss"] < eager[0]["loss"] - 0.05  # the adapters learn


def test_a_frozen_mtp_layer_waits_on_the_host_and_reaches_the_export_as_loaded(tmp_path, capfd):
    """One GPU, LoRA, lora.mtp false: no step runs the MTP layer, so it is held on the host (model_setup.hold_on_host)
    and the GPU's memory goes to the step; validation brings it to the GPU for its pass (val_mtp_loss). The run
    trains, validates, saves, resumes, and its merged export carries the MTP tensors exactly as the base folder on
    disk holds them (the reference: the files, not the model)."""
    from safetensors import safe_open

    from harness.checkpoint.hf_weights import export_hf
    from models.qwen35_moe import get_flavor
    from tests.builders import initialized_model

    flavor = get_flavor("debugmodel_mtp")
    base = tmp_path / "base"
    export_hf(initialized_model(flavor, 3), flavor, str(base), torch.bfloat16)
    flags = ["--config", str(REPO / "train_configs" / "debug_model.toml"), "--model.flavor", "debugmodel_mtp",
             "--lora.enable", "true", "--checkpoint.initial_load_hf", str(base), "--checkpoint.enable", "true",
             "--checkpoint.interval", "2", "--metrics.enable_tensorboard", "false", "--job.dump_folder",
             str(tmp_path / "run"), "--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "2",
             "--validation.dataset_path", str(REPO / "data" / "debug_corpus" / "train.jsonl")]
    assert main([*flags, "--training.steps", "2", "--checkpoint.export_hf_at_end", "false"]) == 0
    assert "MTP layers held on the host" in capfd.readouterr().err
    assert main([*flags, "--training.steps", "4"]) == 0  # resumes from step 2, exports at the end
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    validated = [r for r in records if "val_mtp_loss" in r]
    assert [r["step"] for r in validated] == [2, 4] and all(0 < r["val_mtp_loss"] < 20 for r in validated)

    def mtp_tensors(folder: Path) -> dict[str, torch.Tensor]:
        tensors = {}
        for shard in folder.glob("*.safetensors"):
            with safe_open(str(shard), "pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys() if ".mtp." in k or k.startswith("mtp.")})
        return tensors

    loaded, exported = mtp_tensors(base), mtp_tensors(tmp_path / "run" / "hf")
    assert loaded and exported.keys() == loaded.keys()
    for key, value in loaded.items():
        assert torch.equal(exported[key], value), key


def test_an_fp8_release_base_is_held_in_float8_and_trains_as_its_dequantized_weights(tmp_path, capfd):
    """Compiled, full AC, bf16: the FP8 folder's quantized weights stay float8 on the GPU (dequantized in the compiled
    blocks) and the run follows the one from an unquantized folder of the same weights dequantized (float64
    definition): both compute with those weights rounded once to bf16, so only the graphs' own rounding differs."""
    from harness.checkpoint.hf_weights import export_hf
    from models.qwen35_moe import get_flavor
    from tests.builders import dequantized_folder, fp8_release_folder, initialized_model

    flavor = get_flavor("debugmodel_mtp")
    export_hf(initialized_model(flavor, 3), flavor, str(tmp_path / "fp32"), torch.float32)
    fp8 = fp8_release_folder(tmp_path / "fp32", tmp_path / "fp8")
    plain = dequantized_folder(fp8, tmp_path / "dequantized")
    flags = ["--model.flavor", "debugmodel_mtp", "--compile.enable", "true", "--activation_checkpoint.mode", "full"]
    runs = {}
    for name, folder in (("fp8", fp8), ("dequantized", plain)):
        runs[name] = _run(tmp_path / f"run-{name}", *flags, "--checkpoint.initial_load_hf", str(folder))
        assert ("quantized weights held as stored" in capfd.readouterr().err) == (name == "fp8")
    for ours, theirs in zip(runs["fp8"], runs["dequantized"]):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=2e-3)
    assert runs["fp8"][-1]["loss"] < runs["fp8"][0]["loss"] - 0.05  # the adapters learn


def test_an_fp8_release_dequantizes_on_the_gpu_bit_for_bit_as_on_the_host(tmp_path):
    """A run on the GPU reads an FP8 folder's weights dequantized there (only the float8 values cross the bus): every
    native tensor, the experts fused, equals the host's fp32 dequantization exactly (one IEEE multiply each)."""
    flavor = get_flavor("debugmodel")
    export_hf(initialized_model(flavor, 0), flavor, str(tmp_path / "fp32"), torch.float32)
    folder = fp8_release_folder(tmp_path / "fp32", tmp_path / "fp8")
    shapes, on_host = hf_native_tensors(folder, flavor)
    _, on_gpu = hf_native_tensors(folder, flavor, torch.device("cuda"))
    for key in shapes:
        gpu = on_gpu(key)
        assert gpu.is_cuda, key
        assert torch.equal(gpu.cpu(), on_host(key)), key
