"""LoRA runs end to end on one process: the checkpoint holds the adapters and the base's digest only, resumes bitwise
onto the same base and refuses another (exit 2, one line, the checkpoint untouched); the config's [lora] checks;
the frozen base held in the compute dtype without kept copies."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from harness.checkpoint.hf_weights import export_hf
from harness.checkpoint.plain_state import from_bytes
from harness.train import main
from models.qwen35_moe import Qwen35MoeModel, get_flavor
from models.qwen35_moe.lora import add_adapters, hold_frozen_in
from models.qwen35_moe.lora_targets import DEFAULT_TARGETS, LoraArgs
from parallel.one_device_precision import OneDevicePrecision
from tests.builders import initialized_model
from tests.runs import losses

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "train_configs" / "debug_model.toml")
CORPUS = str(REPO / "data" / "debug_corpus" / "train.jsonl")


def base_folder(path: Path, seed: int) -> Path:
    """An HF export of the debug model drawn from `seed`: the frozen base of the runs here."""
    export_hf(initialized_model(get_flavor("debugmodel"), seed), get_flavor("debugmodel"), str(path), torch.float32)
    return path


def run(dump: Path, base: Path, *extra) -> int:
    return main(["--config", CONFIG, "--training.dataset_path", CORPUS, "--training.seq_len", "64",
                 "--training.local_batch_size", "4", "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1",
                 "--checkpoint.enable", "true", "--checkpoint.initial_load_hf", str(base), "--lora.enable", "true",
                 "--job.dump_folder", str(dump), *extra])


def saved_train_state(step_folder: Path) -> dict:
    reader = FileSystemReader(str(step_folder))
    import torch.distributed.checkpoint as dcp

    state = {"train": b""}
    dcp.load(state, storage_reader=reader)
    return from_bytes(state["train"], "train", step_folder)


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("bases")
    return base_folder(folder / "base", 0), base_folder(folder / "other", 1)


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_bitwise(tmp_path, bases, deterministic_off_after):
    flags = ["--training.deterministic", "true", "--training.steps", "4", "--checkpoint.interval", "2",
             "--checkpoint.keep_latest_k", "0"]
    assert run(tmp_path / "a", bases[0], *flags) == 0
    assert run(tmp_path / "b", bases[0], *flags) == 0
    shutil.rmtree(tmp_path / "b" / "checkpoint" / "step-4")  # as if the run had died after step 2
    assert run(tmp_path / "b", bases[0], *flags) == 0
    assert losses(tmp_path / "b") == losses(tmp_path / "a") and sorted(losses(tmp_path / "a")) == [1, 2, 3, 4]

    step = tmp_path / "a" / "checkpoint" / "step-4"
    keys = {k.removeprefix("model.") for k in FileSystemReader(str(step)).read_metadata().state_dict_metadata
            if k.startswith("model.")}
    assert keys and all(".adapter." in k for k in keys)
    assert any("experts.adapter.gate_up_A" in k for k in keys)
    lora = saved_train_state(step)["lora"]
    assert lora["args"] == {"rank": 16, "alpha": 32.0, "dropout": 0.0, "targets": list(DEFAULT_TARGETS),
                            "mtp": False, "expert_rank": 0}
    assert lora["base"]["source"] == str(bases[0]) and lora["base"]["digest"].startswith("sha256-sampled:")


@pytest.mark.parametrize("change, told", [
    ("base", "its adapters were trained on another base"),
    ("rank", "its adapters were trained with other settings: lora.rank 16 (now 8)"),
    ("expert_rank", "its adapters were trained with other settings: lora.expert_rank 0 (now 8)"),
    ("full", "it holds LoRA adapters only, and this run trains every weight"),
])
def test_a_resume_onto_another_base_or_settings_stops_with_one_line_and_leaves_the_checkpoint(tmp_path, bases, capsys,
                                                                                             change, told):
    assert run(tmp_path, bases[0], "--training.steps", "1") == 0
    step = tmp_path / "checkpoint" / "step-1"
    before = {p: p.read_bytes() for p in step.rglob("*") if p.is_file()}
    capsys.readouterr()
    extra = {"base": [], "rank": ["--lora.rank", "8"], "expert_rank": ["--lora.expert_rank", "8"],
             "full": ["--lora.enable", "false"]}[change]
    assert run(tmp_path, bases[1] if change == "base" else bases[0], "--training.steps", "2", *extra) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and told in errors[0] and "Traceback" not in errors[0]
    assert {p: p.read_bytes() for p in step.rglob("*") if p.is_file()} == before


def test_the_mtp_layers_adapters_train_save_and_export_merged(tmp_path, bases):
    """lora.mtp "lora": the MTP layer's adapters are in the checkpoint and trained (MTP loss on), merged in hf/."""
    assert run(tmp_path, bases[0], "--model.flavor", "debugmodel_mtp", "--model.mtp_num_hidden_layers", "1",
               "--lora.mtp", "lora", "--training.mtp_loss_coef", "0.1", "--training.steps", "2",
               "--checkpoint.initial_load_hf", "") == 0
    keys = FileSystemReader(str(tmp_path / "checkpoint" / "step-2")).read_metadata().state_dict_metadata
    assert any(k.startswith("model.mtp.") and ".adapter." in k for k in keys)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all("mtp_loss" in r for r in rows if "loss" in r)


@pytest.mark.parametrize("flags, problem", [
    (["--lora.rank", "12"], "lora.rank must be a positive multiple of 8, got 12"),
    (["--lora.targets", "q_proj,lm_head"], "lora.targets must be a non-empty list of"),
    (["--lora.mtp", "lora", "--training.mtp_loss_coef", "0"], "needs training.mtp_loss_coef > 0"),
])
def test_lora_settings_no_run_can_use_stop_before_it_starts(tmp_path, bases, capsys, flags, problem):
    assert run(tmp_path, bases[0], *flags) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and problem in errors[0]
    assert not (tmp_path / "checkpoint").exists()


def test_the_frozen_base_is_held_in_the_compute_dtype_with_no_kept_copy():
    args = get_flavor("debugmodel_mtp")
    with torch.device("meta"):
        model = Qwen35MoeModel(args)
        add_adapters(model, LoraArgs(rank=8, alpha=8.0))
    hold_frozen_in(model, torch.bfloat16)
    for name, p in model.named_parameters():
        if ".adapter." in name:
            assert p.dtype == torch.float32 and p.requires_grad, name
        else:  # matrices in bf16; vectors (norms, the fp32 contract's A_log and dt_bias) as they were
            assert p.dtype == (torch.bfloat16 if p.ndim >= 2 else torch.float32) and not p.requires_grad, name
    precision = OneDevicePrecision(torch.bfloat16, kept_copies=True)
    for module in model.modules():
        precision.reader(module) if hasattr(module, "weight_reader") else None
    assert precision._slots == []  # nothing to copy: the base is in bf16 already, the adapters are no Linear


def test_a_fresh_launch_sets_another_lines_peft_adapter_aside_with_its_export(tmp_path, bases):
    assert run(tmp_path, bases[0], "--training.steps", "1", "--checkpoint.enable", "false") == 0
    first = json.loads((tmp_path / "run.json").read_text())["run"]
    before = (tmp_path / "hf-adapter" / "adapter_model.safetensors").read_bytes()
    assert run(tmp_path, bases[0], "--training.steps", "1", "--checkpoint.enable", "false") == 0
    assert (tmp_path / f"hf-adapter-{first}" / "adapter_model.safetensors").read_bytes() == before
    assert (tmp_path / f"hf-{first}").is_dir() and (tmp_path / "hf-adapter").is_dir()


def test_a_checkpoint_saved_before_expert_rank_existed_resumes_with_its_default():
    """Its record has no expert_rank: it trained the experts at lora.rank, what expert_rank 0 means."""
    from harness.lora.base import lora_problem

    base = {"digest": "sha256-sampled:0", "source": ""}
    old = {"args": {"rank": 16, "alpha": 32.0, "dropout": 0.0, "targets": list(DEFAULT_TARGETS), "mtp": False},
           "base": base}
    ours = {"args": {**old["args"], "expert_rank": 0}, "base": base}
    assert lora_problem(old, ours) is None
    assert lora_problem(old, {**ours, "args": {**ours["args"], "expert_rank": 8}}) == (
        "its adapters were trained with other settings: lora.expert_rank 0 (now 8)")
