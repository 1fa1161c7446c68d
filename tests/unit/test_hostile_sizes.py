"""Hostile sizes and values in a config are refused before anything is allocated (harness/memory_check.py,
models/qwen35_moe/args.py): one `error:` line, exit 2, never a traceback, a hang building layers or terabytes
asked of the allocator. The memory floor they are judged by is a floor: no peak measured on a GPU lies under it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from harness.config import DEFAULT_CONFIG, load_config
from harness.memory_check import GIB, memory_floor
from harness.train import BAD_INPUT, main
from models.qwen35_moe import get_flavor
from tests.unit.test_convert_output_folder import one_error

REPO = Path(__file__).resolve().parents[2]
FAST = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false",
        "--training.steps", "1"]


def config_with(tmp_path: Path, **fields) -> str:
    """The debug model's config.json with `fields` changed (written as JSON writes them: NaN and Infinity too)."""
    config = get_flavor("debugmodel").to_hf_config()
    rope = {k: fields[k] for k in ("rope_theta", "partial_rotary_factor") if k in fields}
    config.update(fields)
    config["rope_parameters"].update(rope)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("fields", [{"hidden_size": 10**9}, {"vocab_size": 10**12}, {"moe_intermediate_size": 10**9},
                                    {"num_experts": 10**7}, {"num_hidden_layers": 10**6, "layer_types": None}])
def test_a_model_config_of_hostile_sizes_is_refused_before_anything_is_built(tmp_path, capsys, fields):
    dump = tmp_path / "run"
    assert main([*FAST, "--model.hf_config", config_with(tmp_path, **fields),
                 "--job.dump_folder", str(dump)]) == BAD_INPUT
    line = one_error(capsys, logged=True)
    assert "the run cannot fit: each process needs at least" in line and "GiB of memory per process" in line, line
    assert not dump.exists()


@pytest.mark.parametrize("flags", [["--lora.enable", "true", "--lora.rank", "1000000008"],
                                   ["--training.local_batch_size", "10000000"]])
def test_hostile_run_sizes_are_refused_before_anything_is_built(tmp_path, capsys, flags):
    dump = tmp_path / "run"
    assert main([*FAST, *flags, "--job.dump_folder", str(dump)]) == BAD_INPUT
    assert "the run cannot fit" in one_error(capsys, logged=True)
    assert not dump.exists()


def test_the_trainer_judges_its_own_device_too(tmp_path, monkeypatch):
    """The check the trainer makes once it has its device (there: a GPU's memory), before it builds the model: here
    the host's memory, made small."""
    import harness.memory_check as memory_check
    from harness.config import ConfigError
    from harness.trainer import Trainer

    cfg = load_config(["--config", str(DEFAULT_CONFIG), *FAST, "--job.dump_folder", str(tmp_path / "run")])
    monkeypatch.setattr(memory_check, "host_memory_per_process", lambda processes: 2**20)
    with pytest.raises(ConfigError, match="the run cannot fit: .* more than this host's 0.0 GiB"):
        Trainer(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("fields, named", [
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be in (0, 1), got nan"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps must be in (0, 1), got 0.0"),
    ({"rope_theta": float("inf")}, "rope_theta must be positive and finite, got inf"),
    ({"partial_rotary_factor": 0.0}, "partial_rotary_factor must be in (0, 1], got 0.0"),
    ({"router_aux_loss_coef": -1.0}, "router_aux_loss_coef must be >= 0 and finite, got -1.0"),
    ({"initializer_range": float("nan")}, "initializer_range must be >= 0 and finite, got nan"),
])
def test_non_finite_or_out_of_range_model_values_are_refused_naming_the_field(tmp_path, capsys, fields, named):
    """Before, `rms_norm_eps: NaN` trained and exited 3 at the first step, blaming the learning rate."""
    assert main([*FAST, "--model.hf_config", config_with(tmp_path, **fields),
                 "--job.dump_folder", str(tmp_path / "run")]) == BAD_INPUT
    assert named in one_error(capsys, logged=True)


def test_no_peak_measured_on_a_gpu_lies_under_the_floor():
    """benchmarks/memory_model.py's peaks, measured on H200s (full fine-tunes) and the LoRA run of 35B-A3B on one
    H200 (84.6 GiB at one 4096-token row, rank 16: docs/performance.md): each is above the floor of its setup."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from bench_model import bench_args
    from memory_model import MEASURED

    def floor(args, gpus, cp, seq, local_batch, lora_rank=0, chunk=2048) -> float:
        flags = ["--training.seq_len", str(seq), "--training.local_batch_size", str(local_batch),
                 "--training.loss_chunk_tokens", str(chunk)]
        if lora_rank:
            flags += ["--lora.enable", "true", "--lora.rank", str(lora_rank)]
        cfg = load_config(["--config", str(DEFAULT_CONFIG), *flags])
        return sum(memory_floor(cfg, args, gpus, cp, on_gpu=True).values()) / GIB

    for layers, experts, setup, measured in MEASURED:
        below = floor(bench_args(layers, experts), setup.gpus, setup.cp, setup.seq, setup.local_batch)
        assert below < measured, (layers, experts, setup, below, measured)
    assert floor(get_flavor("35B-A3B"), 1, 1, 4096, 1, lora_rank=16, chunk=4096) < 84.6


@pytest.mark.parametrize("base, fp8_base, fits", [("fp8", "held", True), ("fp8", "dequantized", False),
                                                  ("bf16", "held", False)])
def test_a_48_gb_card_takes_lora_from_an_fp8_base_held_in_float8(tmp_path, base, fp8_base, fits):
    """The 80gb config from the FP8 release on a 48 GB card (an L40S: 44.99 GiB; the memory model predicts 44.3 GiB,
    docs/performance.md): its frozen weights floored at their float8 byte, a floor of 37.0 GiB, where bf16's 2 B
    (69.3 GiB) refused the very run the FP8 base is for. From the bf16 release, or with the base dequantized, it
    cannot fit."""
    from harness.memory_check import memory_problem

    args = get_flavor("35B-A3B")
    config = args.to_hf_config()
    if base == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = load_config(["--config", str(REPO / "train_configs" / "qwen35_moe_lora_80gb.toml"),
                       "--checkpoint.initial_load_hf", str(tmp_path), "--lora.fp8_base", fp8_base])
    floor = sum(memory_floor(cfg, args, 1, 1, on_gpu=True).values()) / GIB
    assert (floor < 40) == fits and 30 < floor < 70, floor
    problem = memory_problem(cfg, args, 1, 1, True, int(44.99 * GIB), "the 44.99 GiB of this L40S")
    assert (problem is None) == fits, problem


def test_a_capped_gpu_is_judged_by_its_cap(tmp_path, monkeypatch):
    """A GPU process capped with torch.cuda.set_per_process_memory_fraction (a smaller card's stand-in:
    benchmarks/lora_one_gpu.py --memory-cap-gib) is judged against the cap, as the smaller card would be: the 80gb
    config from a bf16 base (a floor of 69.3 GiB) is refused on an H200 capped at 46 GiB and taken uncapped."""
    import types

    import torch

    from harness.memory_check import device_memory_problem

    (tmp_path / "config.json").write_text(json.dumps(get_flavor("35B-A3B").to_hf_config()))
    cfg = load_config(["--config", str(REPO / "train_configs" / "qwen35_moe_lora_80gb.toml"),
                       "--checkpoint.initial_load_hf", str(tmp_path)])
    h200 = types.SimpleNamespace(total_memory=int(139.8 * GIB), name="NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: h200)
    for fraction, refused in ((46 / 139.8, True), (1.0, False)):
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: fraction)
        problem = device_memory_problem(cfg, get_flavor("35B-A3B"), 1, 1, torch.device("cuda", 0))
        assert (problem is not None) == refused, problem
        if refused:
            assert "more than the 46.0 GiB this process may allocate (set_per_process_memory_fraction 0.329041) of this NVIDIA H200" in problem, problem
