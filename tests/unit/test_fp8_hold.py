"""A LoRA run's frozen base held as the FP8 release stores it (models/qwen35_moe/fp8_hold.py): float8 values and
block scales in memory, dequantized where each module computes. Checked against a float64 dequantization written in
tests/builders.py (`fp8_reference`) and against the same run from an unquantized folder holding those dequantized
weights: the same model numbers, so on a CPU the same losses, bit for bit, and the same exports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.checkpoint.hf_weights import export_hf, hf_fp8_tensors, load_hf_weights, model_native_tensors
from harness.lora.run import LoraRun
from harness.train import main
from models.qwen35_moe import Qwen35MoeModel, get_flavor
from models.qwen35_moe.fp8_hold import dequantized, held_fp8_weights
from models.qwen35_moe.hf_checkpoint import from_pretrained
from models.qwen35_moe.hooks import canonical_name
from models.qwen35_moe.lora import add_adapters, hold_frozen_in
from models.qwen35_moe.lora_targets import LoraArgs
from tests.builders import dequantized_folder, fp8_reference, fp8_release_folder, initialized_model

REPO = Path(__file__).resolve().parents[2]
FLAVOR = get_flavor("debugmodel")  # moe_intermediate 32: gate and up each one edge block, not the stacked weight's
RUN = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false",
       "--training.steps", "3", "--metrics.log_freq", "1", "--lora.enable", "true",
       "--activation_checkpoint.mode", "full", "--checkpoint.export_hf_at_end", "true",
       "--checkpoint.export_dtype", "float32",
       "--training.dataset_path", str(REPO / "data" / "debug_corpus" / "train.jsonl")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """The FP8 release folder, and the same weights dequantized (float64 definition, stored in fp32) in an
    unquantized folder."""
    root = tmp_path_factory.mktemp("fp8-hold")
    export_hf(initialized_model(FLAVOR, 3), FLAVOR, str(root / "fp32"), torch.float32)
    fp8 = fp8_release_folder(root / "fp32", root / "fp8")
    return {"fp8": fp8, "dequantized": dequantized_folder(fp8, root / "dequantized")}


def _held_model(folder: Path) -> Qwen35MoeModel:
    """A LoRA model (default targets) built as the trainer builds one, its base held in FP8 and loaded."""
    keys, _ = hf_fp8_tensors(folder, FLAVOR)
    with torch.device("meta"):
        model = Qwen35MoeModel(FLAVOR)
    add_adapters(model, LoraArgs(rank=4, alpha=8.0))
    hold_frozen_in(model, None, keys)
    model.to_empty(device="cpu")
    model.init_weights(0)
    load_hf_weights(model, FLAVOR, str(folder))
    return model


def test_every_quantized_weight_is_held_in_float8_and_reads_as_the_float64_definition(folders):
    model = _held_model(folders["fp8"])
    stored = load_file(folders["fp8"] / "model.safetensors")
    held = {canonical_name(k): where for k, where in held_fp8_weights(model).items()}
    quantized = {k for k, v in stored.items() if v.dtype == torch.float8_e4m3fn}
    experts = {k for k in quantized if ".experts." in k}
    # each dense quantized weight is one held parameter; the per-expert ones are fused into two per layer
    assert len(held) == len(quantized - experts) + 2 * FLAVOR.num_hidden_layers
    assert all(getattr(m, n).dtype == torch.float8_e4m3fn and not getattr(m, n).requires_grad
               for m, n in held.values())
    q_proj = "layers.1.self_attn.q_proj.weight"
    stored_key = f"model.{q_proj}"
    assert torch.equal(dequantized(*held[q_proj], torch.float64),
                       fp8_reference(stored[stored_key], stored[stored_key + "_scale_inv"]))
    gate_up = dequantized(*held["layers.0.mlp.experts.gate_up_proj"], torch.float64)
    down = dequantized(*held["layers.0.mlp.experts.down_proj"], torch.float64)
    rows = FLAVOR.moe_intermediate_size
    for e in range(FLAVOR.num_experts):
        for half, name in enumerate(("gate_proj", "up_proj")):
            key = f"model.layers.0.mlp.experts.{e}.{name}.weight"
            assert torch.equal(gate_up[e, half * rows:(half + 1) * rows],
                               fp8_reference(stored[key], stored[key + "_scale_inv"]))
        key = f"model.layers.0.mlp.experts.{e}.down_proj.weight"
        assert torch.equal(down[e], fp8_reference(stored[key], stored[key + "_scale_inv"]))
    # the export's reader gives the held weights dequantized (fp32), the rest as loaded
    _, read = model_native_tensors(model)
    assert torch.equal(read(q_proj), fp8_reference(stored[stored_key], stored[stored_key + "_scale_inv"]).float())
    assert read(q_proj).dtype == torch.float32


def test_with_untrained_adapters_the_held_model_gives_the_dequantized_models_logits(folders):
    """B = 0: the FP8-held model's logits are those of the model loaded from the dequantized folder, bit for bit."""
    held = _held_model(folders["fp8"]).eval()
    reference = from_pretrained(folders["dequantized"], dtype=torch.float32).eval()
    ids = torch.randint(0, FLAVOR.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(held(ids).logits, reference(ids).logits)


def test_a_lora_run_on_the_held_fp8_base_is_the_run_on_the_dequantized_base(folders, tmp_path, capsys):
    """Same losses, grad norms and exports (merged model and PEFT adapter) as the run whose base is the dequantized
    folder, and as the run that dequantizes the FP8 folder at its load (lora.fp8_base dequantized): the held weights
    enter every computation as the same fp32 numbers."""
    runs = {}
    for name in ("fp8", "dequantized", "fp8 dequantized at the load"):
        dump = tmp_path / name.replace(" ", "-")
        folder, hold = (folders["fp8"], "dequantized") if name.endswith("load") else (folders[name], "held")
        assert main([*RUN, "--checkpoint.initial_load_hf", str(folder), "--lora.fp8_base", hold,
                     "--job.dump_folder", str(dump)]) == 0
        log = capsys.readouterr().err
        assert ("quantized weights held as stored" in log) == (name == "fp8")
        assert ("held dequantized, in the compute dtype: lora.fp8_base is dequantized" in log) == (hold != "held")
        rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
        runs[name] = [(r["loss"], r["grad_norm"]) for r in rows if "loss" in r]
        runs[name + "_export"] = {k: v for s in sorted((dump / "hf").glob("*.safetensors")) for k, v in load_file(s).items()}
        runs[name + "_adapter"] = load_file(dump / "hf-adapter" / "adapter_model.safetensors")
    for other in ("dequantized", "fp8 dequantized at the load"):
        assert len(runs["fp8"]) == 3 and runs["fp8"] == runs[other]
        for part in ("_export", "_adapter"):
            ours, theirs = runs["fp8" + part], runs[other + part]
            assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_under_expert_parallelism_the_fp8_base_is_held_dequantized_and_the_log_says_why(folders, caplog):
    """Under EP a rank's experts would need their own slice of the scales: not held (FSDP alone holds it:
    tests/distributed/test_fp8_hold_fsdp.py)."""
    run = LoraRun(LoraArgs(rank=4, alpha=8.0), str(folders["fp8"]), 0)
    with caplog.at_level("INFO", logger="harness.lora.run"):
        assert run.fp8_held_keys(FLAVOR, expert_parallel=True, full_ac=True) == frozenset()
    assert "held dequantized, in the compute dtype: FP8 holding does not shard the experts by expert parallelism" \
        in caplog.text
    assert len(run.fp8_held_keys(FLAVOR, expert_parallel=False, full_ac=True)) > 10


def test_without_full_activation_checkpointing_the_fp8_base_is_held_dequantized(folders, tmp_path, capsys):
    assert main([*RUN, "--activation_checkpoint.mode", "none", "--checkpoint.export_hf_at_end", "false",
                 "--checkpoint.initial_load_hf", str(folders["fp8"]), "--job.dump_folder", str(tmp_path / "r")]) == 0
    assert "held dequantized, in the compute dtype: FP8 holding needs activation_checkpoint.mode full" in \
        capsys.readouterr().err


@pytest.mark.parametrize("key, byte, native", [  # e4m3fn's two NaNs; the weight as the model names it
    ("model.layers.0.mlp.experts.2.down_proj.weight", 0x7F, "layers.0.mlp.experts.down_proj"),
    ("model.layers.1.self_attn.o_proj.weight", 0xFF, "layers.1.self_attn.o_proj.weight")])
def test_a_nan_stored_in_a_held_weight_is_a_damaged_folder_not_a_nan_loss(folders, tmp_path, capsys, key, byte,
                                                                          native):
    """The held path copies the float8 values as stored: a NaN byte among them is found there (exit 2, the weight
    named), as the dequantizing path finds it, not at step 1's loss (exit 3)."""
    folder = tmp_path / "release"
    shutil.copytree(folders["fp8"], folder)
    tensors = load_file(folder / "model.safetensors")
    raw = tensors[key].view(torch.uint8).clone()
    raw.view(-1)[11] = byte
    tensors[key] = raw.view(torch.float8_e4m3fn)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert main([*RUN, "--checkpoint.initial_load_hf", str(folder), "--job.dump_folder", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "quantized weights held as stored" in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: checkpoint.initial_load_hf {folder}: 1 weight holds NaN or infinite values ({native}): the folder is "
        "damaged; download or convert it again"]
