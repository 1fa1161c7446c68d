"""benchmarks/lora_one_gpu.py reads its figures (load and first-step times, checkpoint save, export) from the
trainer's log: its patterns held to the lines a LoRA run prints, the model named by flavor or by config path (the
full-size runs name the flavor, whose line the load time once went unread by)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.train import main
from models.qwen35_moe import get_flavor
from tests.benchmarks.scripts import loaded

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("model", ["flavor", "hf_config"])
def test_the_patterns_match_a_lora_runs_log(tmp_path, capsys, monkeypatch, model):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # its own imports, as when run as a script
    lora_one_gpu = loaded("lora_one_gpu.py")
    if model == "flavor":
        named = ["--model.flavor", "debugmodel"]
    else:
        config = tmp_path / "config.json"
        config.write_text(json.dumps(get_flavor("debugmodel").to_hf_config()))
        named = ["--model.hf_config", str(config)]
    assert main([*named, "--training.seq_len", "64", "--training.local_batch_size", "2", "--training.steps", "2",
                 "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.export_hf_at_end", "true", "--lora.enable", "true",
                 "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1", "--job.dump_folder", str(tmp_path / "run"),
                 "--training.dataset_path", str(REPO / "data" / "debug_corpus" / "train.jsonl")]) == 0
    printed = capsys.readouterr()
    log = printed.out + printed.err  # the script reads the run's stdout and stderr together
    built = [line for line in log.splitlines() if re.search(lora_one_gpu.BUILT, line)]
    assert len(built) == 1 and (" model flavor debugmodel: " in built[0] if model == "flavor" else str(config) in built[0])
    assert re.search(lora_one_gpu.FIRST_STEP, log)
    assert re.findall(lora_one_gpu.SAVED, log)
    exported = re.findall(lora_one_gpu.EXPORTED, log)
    assert len(exported) == 1 and exported[0][0].endswith("hf"), exported
