"""DCP checkpoints on one process: when they are saved and pruned, exact resume, what is never taken as the
latest, clear errors that leave the folder as it was, the fp32 contract through a save, the offline converter.
(FSDP over 2 ranks, resharding and signals: tests/distributed/test_resume.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from harness.checkpoint.integrity import COMPLETE
from harness.checkpoint.step_folders import step_folders
from harness.convert import main as convert_main
from harness.run_lock import LOCK_FILE
from harness.train import main
from tests.runs import losses

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "train_configs" / "debug_model.toml")
CORPUS = str(REPO / "data" / "debug_corpus" / "train.jsonl")


def run(dump: Path, *extra) -> int:
    return main(["--config", CONFIG, "--training.dataset_path", CORPUS, "--training.seq_len", "64",
                 "--training.local_batch_size", "4", "--metrics.enable_tensorboard", "false",
                 "--checkpoint.enable", "true", "--job.dump_folder", str(dump), *extra])


@pytest.fixture
def deterministic(deterministic_off_after):
    return ["--training.deterministic", "true", "--metrics.log_freq", "1"]


def test_saves_every_interval_and_at_the_end_and_keeps_the_latest_k(tmp_path):
    assert run(tmp_path, "--training.steps", "5", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2") == 0
    steps = step_folders(tmp_path / "checkpoint")
    assert sorted(steps) == [4, 5]  # 2 was pruned
    # what is left beside them: the run's lock of its checkpoint folder (harness/run_lock.py)
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == [LOCK_FILE, "step-4", "step-5"]
    record = json.loads((steps[5] / COMPLETE).read_text())
    assert (record["step"], record["world_size"]) == (5, 1)
    assert {".metadata", "__0_0.distcp", "hf/config.json", "hf/tokenizer.json"} <= record["files"].keys()
    assert (steps[5] / "hf" / "config.json").is_file() and (steps[5] / "hf" / "tokenizer.json").is_file()


def test_resume_reproduces_the_uninterrupted_run_bitwise(tmp_path, deterministic):
    flags = [*deterministic, "--training.steps", "6", "--checkpoint.interval", "3", "--checkpoint.keep_latest_k", "0"]
    assert run(tmp_path / "a", *flags) == 0
    assert run(tmp_path / "b", *flags) == 0
    # Drop what came after step 3, as if the run had died there, and go again.
    import shutil

    shutil.rmtree(tmp_path / "b" / "checkpoint" / "step-6")
    assert run(tmp_path / "b", *flags) == 0
    assert losses(tmp_path / "b") == losses(tmp_path / "a")  # steps 1-3 kept, 4-6 recomputed: equal bits
    assert sorted(losses(tmp_path / "b")) == [1, 2, 3, 4, 5, 6]  # metrics.jsonl continued, not duplicated


def test_a_save_killed_midway_is_never_the_latest(tmp_path, capsys):
    assert run(tmp_path, "--training.steps", "4", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0") == 0
    step4 = tmp_path / "checkpoint" / "step-4"
    (step4 / COMPLETE).unlink()  # as a save killed before its end leaves it
    next(step4.glob("*.distcp")).write_bytes(b"cut")
    capsys.readouterr()
    assert run(tmp_path, "--training.steps", "5", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0") == 0
    err = capsys.readouterr().err
    assert "resumed from checkpoint" in err and "step-2 (step 2)" in err
    assert sorted(step_folders(tmp_path / "checkpoint")) == [2, 4, 5]  # step-4 written again, complete


def test_a_corrupt_checkpoint_without_checksums_stops_with_its_name_and_stays_as_it_was(tmp_path, capsys):
    """A checkpoint saved before COMPLETE held digests is resumed unverified: DCP's reader then finds the damage.
    (With digests, verification finds it first: tests/unit/test_checkpoint_integrity.py.)"""
    assert run(tmp_path, "--training.steps", "2", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0") == 0
    (tmp_path / "checkpoint" / "step-2" / COMPLETE).write_text(json.dumps({"step": 2, "world_size": 1}) + "\n")
    data = next((tmp_path / "checkpoint" / "step-2").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    before = data.read_bytes()
    capsys.readouterr()
    assert run(tmp_path, "--training.steps", "3") == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: cannot load checkpoint") and "step-2" in errors[0]
    assert "corrupted" in errors[0]  # the reader's own diagnosis, in one line
    assert errors[0].endswith("resume it with checkpoint.load_step (complete ones: step-1)")  # the way out
    assert data.read_bytes() == before


def test_a_checkpoint_of_another_model_is_named_as_such(tmp_path, capsys):
    assert run(tmp_path, "--training.steps", "1") == 0
    config = json.loads((tmp_path / "checkpoint" / "step-1" / "hf" / "config.json").read_text())
    config["num_experts"] = 4  # another model shape
    other = tmp_path / "other.json"
    other.write_text(json.dumps(config))
    capsys.readouterr()
    assert run(tmp_path, "--training.steps", "2", "--model.hf_config", str(other)) == 2
    err = capsys.readouterr().err
    assert "step-1 was saved for another model" in err and "wrong shapes" in err and "mlp.gate.weight" in err


@pytest.mark.parametrize("saved, resumed, told", [("debugmodel", "debugmodel_mtp", 0), ("debugmodel_mtp", "debugmodel", 1)])
def test_a_checkpoint_that_differs_in_its_mtp_layers_only_says_which_setting_resumes_it(tmp_path, capsys, saved,
                                                                                        resumed, told):
    """A checkpoint saved before the flavors had their MTP layer (or with one the relaunch lacks): the error names
    model.mtp_num_hidden_layers, and the relaunch with it resumes."""
    assert run(tmp_path, "--training.steps", "1", "--model.flavor", saved) == 0
    capsys.readouterr()
    assert run(tmp_path, "--training.steps", "2", "--model.flavor", resumed) == 2
    err = capsys.readouterr().err
    assert f"The difference is the MTP layers: resume with model.mtp_num_hidden_layers {told}." in err
    assert run(tmp_path, "--training.steps", "2", "--model.flavor", resumed,
               "--model.mtp_num_hidden_layers", str(told)) == 0


def test_a_missing_load_step_lists_the_complete_ones(tmp_path, capsys):
    assert run(tmp_path, "--training.steps", "2", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0") == 0
    capsys.readouterr()
    assert run(tmp_path, "--training.steps", "3", "--checkpoint.load_step", "7") == 2
    assert "complete ones: step-1, step-2" in capsys.readouterr().err


def test_fp32_parameters_from_a_bf16_hf_checkpoint_stay_fp32_and_exact_through_a_save_and_resume(tmp_path):
    """A bf16 HF checkpoint still holds A_log, dt_bias and the GDN norm in F32: they load, train, save and resume
    in fp32, with values that are not bf16-representable kept exactly."""
    from torch.distributed.checkpoint import FileSystemReader

    from models.qwen35_moe import get_flavor, save_hf_checkpoint
    from tests.builders import initialized_model

    model = initialized_model(get_flavor("debugmodel"))
    with torch.no_grad():
        for layer in model.layers.values():
            if hasattr(layer, "linear_attn"):  # off their round initial values (1.0), below bf16's resolution
                for p in (layer.linear_attn.norm.weight, layer.linear_attn.dt_bias):
                    p.add_(torch.randn(p.shape) * 1e-3)
    save_hf_checkpoint(model.state_dict(), model.args, tmp_path / "init", dtype=torch.bfloat16)
    assert run(tmp_path / "run", "--training.steps", "1", "--checkpoint.initial_load_hf", str(tmp_path / "init"),
               "--optimizer.lr", "1e-12") == 0  # a step that barely moves the weights
    metadata = FileSystemReader(str(tmp_path / "run" / "checkpoint" / "step-1")).read_metadata().state_dict_metadata
    fp32 = [k for k in metadata if k.startswith("model.") and k.endswith(("A_log", "dt_bias", "linear_attn.norm.weight"))]
    assert fp32 and all(metadata[k].properties.dtype == torch.float32 for k in fp32)

    from torch.distributed.checkpoint import load

    saved = {k: torch.empty(tuple(metadata[k].size), dtype=torch.float32) for k in fp32}
    load(saved, checkpoint_id=str(tmp_path / "run" / "checkpoint" / "step-1"), no_dist=True)
    init = model.state_dict()
    for key, value in saved.items():
        start = init[key.removeprefix("model.")]
        assert not torch.equal(start, start.bfloat16().float())  # not bf16-representable: rounding would show
        torch.testing.assert_close(value, start, rtol=0, atol=1e-9)  # lr 1e-12: within rounding of the start


def test_converter_writes_the_end_of_run_export_byte_for_byte_and_it_loads_in_transformers(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from models.qwen35_moe import from_pretrained
    from tests.hf_reference import force_transformers_torch_kernels

    force_transformers_torch_kernels(monkeypatch)
    assert run(tmp_path, "--training.steps", "2", "--checkpoint.export_hf_at_end", "true",
               "--checkpoint.export_dtype", "float32") == 0
    assert convert_main([str(tmp_path / "checkpoint" / "step-2"), str(tmp_path / "converted")]) == 0
    exported = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert sorted(p.name for p in (tmp_path / "converted").iterdir()) == exported
    for name in exported:
        assert (tmp_path / "converted" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "converted", attn_implementation="eager").eval()
    ids = torch.randint(0, 258, (1, 40))
    with torch.no_grad():
        diff = (hf(input_ids=ids).logits - from_pretrained(tmp_path / "converted")(ids).logits).abs().max().item()
    assert diff < 1e-4


def test_converter_with_a_small_shard_size_writes_an_index_and_the_same_tensors(tmp_path):
    from models.qwen35_moe import load_hf_state_dict

    assert run(tmp_path, "--training.steps", "1", "--checkpoint.export_hf_at_end", "true") == 0
    assert convert_main([str(tmp_path / "checkpoint" / "step-1"), str(tmp_path / "c"), "--max-shard-gib", "0.0005"]) == 0
    assert (tmp_path / "c" / "model.safetensors.index.json").is_file()
    a, b = load_hf_state_dict(tmp_path / "hf"), load_hf_state_dict(tmp_path / "c")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def test_converter_rejects_a_folder_without_dcp_metadata(tmp_path, capsys):
    (tmp_path / "checkpoint" / "step-3").mkdir(parents=True)
    assert convert_main([str(tmp_path / "checkpoint"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no .metadata" in err and "name one of them" in err


def test_converter_refuses_a_step_whose_metadata_is_damaged_in_one_line(tmp_path, capsys):
    """A cut-off or foreign .metadata (unpickling fails) is named before anything is written, not a traceback."""
    (tmp_path / "step-3").mkdir()
    (tmp_path / "step-3" / ".metadata").write_bytes(b"\x80\x04\x95")  # a pickle cut off after its header
    assert convert_main([str(tmp_path / "step-3"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and ".metadata is unreadable" in err
    assert not (tmp_path / "out").exists()


def test_converter_names_every_bad_argument_in_one_line(tmp_path, capsys):
    assert convert_main([str(tmp_path / "step-1"), str(tmp_path / "out"), "--dtype", "int8",
                         "--max-shard-gib", "-1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --dtype 'int8' is not one of float32, bfloat16, float16; --max-shard-gib '-1' is not a positive "
        "number of GiB"]
    with pytest.raises(SystemExit) as e:  # argparse's own findings: one line too, not its usage block
        convert_main([str(tmp_path / "step-1")])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: the following arguments are required: out_dir (python -m harness.convert --help lists the arguments)"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """The HF folder a one-step run exports."""
    dump = tmp_path_factory.mktemp("exported")
    assert run(dump, "--training.steps", "1", "--checkpoint.enable", "false") == 0
    return dump / "hf"


def _wrong_shape(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    key = next(k for k in sorted(tensors) if k.endswith("q_proj.weight"))
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def _truncated(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])


def _index_without_weight_map(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')


def _non_finite(folder: Path) -> None:
    """A NaN in one weight, an infinity in another, both whole (a broken conversion, not a cut-off file)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.experts.down_proj"][3, 1, 2] = float("nan")
    tensors["model.norm.weight"][5] = float("-inf")
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("damage, named", [(_wrong_shape, "wrong shapes: layers.1.self_attn.q_proj.weight"),
                                           (_truncated, "cannot read"),
                                           (_index_without_weight_map, "is not a safetensors index"),
                                           (_non_finite, "2 weights hold NaN or infinite values "
                                                         "(layers.0.mlp.experts.down_proj, norm.weight)")])
def test_an_hf_folder_to_start_from_that_does_not_fit_is_one_error_line(exported, tmp_path, capsys, damage, named):
    """checkpoint.initial_load_hf holding another model's tensors, a cut-off file, a broken index or non-finite
    weights: exit 2 with one line naming the key and the folder, not a traceback of the model's build nor a NaN loss
    (exit 3) at step 1."""
    folder = tmp_path / "hf"
    shutil.copytree(exported, folder)
    damage(folder)
    capsys.readouterr()
    assert run(tmp_path / "o", "--training.steps", "1", "--checkpoint.initial_load_hf", str(folder)) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert errors[0].startswith(f"error: checkpoint.initial_load_hf {folder}: ") and named in errors[0], err[-2000:]
    assert len(errors) == 1 and "Traceback" not in err


def test_async_saves_complete_and_resume_like_sync_ones(tmp_path, deterministic):
    flags = [*deterministic, "--training.steps", "4", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]
    assert run(tmp_path / "sync", *flags) == 0
    assert run(tmp_path / "async", *flags, "--checkpoint.async_mode", "async") == 0
    assert sorted(step_folders(tmp_path / "async" / "checkpoint")) == [2, 4]
    import shutil

    shutil.rmtree(tmp_path / "async" / "checkpoint" / "step-4")
    assert run(tmp_path / "async", *flags, "--checkpoint.async_mode", "async") == 0
    assert losses(tmp_path / "async") == losses(tmp_path / "sync")
