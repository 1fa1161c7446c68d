"""The folder a run starts from (checkpoint.initial_load_hf) says which model its weights are of: a run that names
another model (top-k, rope_theta, rms_norm_eps, ...) is refused naming each difference, and a run that names none
trains the folder's model, whose export then says the same (harness/config/run_requirements.py, load.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.train import BAD_INPUT, main

REPO = Path(__file__).resolve().parents[2]
FAST = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false",
        "--training.steps", "1"]


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    """An export of the debug model whose config.json says top-k 4, rope_theta 1e6 and rms_norm_eps 0.5: what a
    release of another shape looks like to the run (the weights' shapes are the same)."""
    dump = tmp_path_factory.mktemp("release")
    assert main([*FAST, "--job.dump_folder", str(dump), "--checkpoint.export_hf_at_end", "true"]) == 0
    path = dump / "hf" / "config.json"
    config = json.loads(path.read_text())
    config.update(num_experts_per_tok=4, rms_norm_eps=0.5)
    config["rope_parameters"]["rope_theta"] = 1e6
    path.write_text(json.dumps(config))
    return dump / "hf"


def test_a_run_naming_another_model_than_its_starting_folders_is_refused_naming_each_difference(
        release, tmp_path, capsys):
    """Before, it trained silently as top-k 2, theta 1e4, eps 1e-6, and its export's config.json described neither."""
    assert main([*FAST, "--checkpoint.initial_load_hf", str(release), "--job.dump_folder",
                 str(tmp_path / "run")]) == BAD_INPUT  # the default config names model.flavor debugmodel
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    for difference in ("num_experts_per_tok 4 (the run: 2)", "rope_theta 1000000.0 (the run: 10000.0)",
                       "rms_norm_eps 0.5 (the run: 1e-06)"):
        assert difference in lines[0], lines[0]
    assert "holds another model than model.flavor 'debugmodel'" in lines[0]
    assert not (tmp_path / "run").exists()


def test_a_run_that_names_no_model_trains_the_starting_folders_and_exports_it(release, tmp_path, capsys):
    config = tmp_path / "from_release.toml"
    config.write_text(f'[training]\ndataset_source = "jsonl"\n'
                      f'dataset_path = "{REPO / "data" / "debug_corpus" / "train.jsonl"}"\n'
                      f'[checkpoint]\ninitial_load_hf = "{release}"\nexport_hf_at_end = true\n')
    assert main(["--config", str(config), *FAST, "--job.dump_folder", str(tmp_path / "run")]) == 0
    assert f"notice: the model is {release / 'config.json'}" in capsys.readouterr().err
    exported = json.loads((tmp_path / "run" / "hf" / "config.json").read_text())
    assert exported["num_experts_per_tok"] == 4 and exported["rms_norm_eps"] == 0.5
    assert exported["rope_parameters"]["rope_theta"] == 1e6


def test_a_starting_folder_without_config_json_is_refused(release, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes((release / "model.safetensors").read_bytes())
    assert main([*FAST, "--checkpoint.initial_load_hf", str(bare), "--job.dump_folder",
                 str(tmp_path / "run")]) == BAD_INPUT
    assert "holds no config.json" in capsys.readouterr().err
