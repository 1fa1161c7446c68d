"""An export replaces the folder it writes (and deletes `<folder>.tmp` / `<folder>.old` beside it): it may do so only
to a folder an export of this program wrote, or an empty one, never to one that holds the step being converted
(docs/design.md, "Checkpoint keys and dtypes"). Everything else is one `error:` line, exit 2, and no file touched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.hf_weights import check_hf_export_folder, export_hf, write_hf_meta
from harness.checkpoint.integrity import ALGORITHM, digest_files, rank_0_files, rank_data_files, write_complete
from harness.convert import main as convert_main
from models.qwen35_moe import get_flavor
from models.qwen35_moe.hf_checkpoint import EXPORT_MARKER
from tests.builders import initialized_model

ARGS = get_flavor("debugmodel_mtp")


def saved_step(step_dir: Path, model, args, export_dtype: str = "bfloat16") -> Path:
    """A checkpoint step as the trainer leaves it for the converter: the model's tensors under `model.` (DCP),
    hf/config.json, and COMPLETE with every file's digest."""
    step_dir.mkdir(parents=True)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step_dir), no_dist=True)
    (step_dir / "hf").mkdir()
    write_hf_meta(step_dir / "hf", args, export_dtype, None)
    names = [*rank_data_files(step_dir, 0), *rank_0_files(step_dir)]
    write_complete(step_dir, {"step": 20, "world_size": 1, "checksum": ALGORITHM,
                              "files": digest_files(step_dir, names, threads=1)})
    return step_dir


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    """A run's dump folder: its checkpoint step, metrics, config, TensorBoard events, token cache, and a file of the
    user's own."""
    run = tmp_path_factory.mktemp("run")
    saved_step(run / "checkpoint" / "step-20", initialized_model(ARGS), ARGS)
    for name, text in {"metrics.jsonl": '{"step": 20}\n', "config.toml": "[job]\n", "tb/events.out": "events",
                       "dataset_cache/tokens.bin": "tokens", "notes.txt": "mine"}.items():
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    return run


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_error(capsys, logged: bool = False) -> str:
    """The one `error:` line on stderr (beside the trainer's log lines where `logged`), with no traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("warning:")]
    if logged:
        lines = [line for line in lines if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_converting_into_the_run_folder_or_the_step_is_refused_and_leaves_every_file(run_folder, tmp_path, capsys):
    step = run_folder / "checkpoint" / "step-20"
    before = files_under(run_folder)
    (tmp_path / "link").symlink_to(run_folder)  # the run folder under another name
    for out in (run_folder, run_folder / "checkpoint", step, step / "hf", step / "export", tmp_path / "link"):
        assert convert_main([str(step), str(out)]) == 2, out
        error = one_error(capsys)
        assert str(out) in error and "the checkpoint" in error and "outside it" in error, error
        assert files_under(run_folder) == before, out
    assert not (step / "export").exists() and not any(p.name.endswith((".tmp", ".old")) for p in run_folder.rglob("*"))


def test_converting_into_a_folder_of_other_files_is_refused_and_keeps_them(run_folder, tmp_path, capsys, monkeypatch):
    """Also `.`: the current folder (no traceback from a path without a name)."""
    step = run_folder / "checkpoint" / "step-20"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    monkeypatch.chdir(mine)
    for out in (str(mine), "."):
        assert convert_main([str(step), out]) == 2
        error = one_error(capsys)
        assert f"{out} " in error and str(mine) in error and f"no {EXPORT_MARKER}" in error, error
        assert "before exports were marked: delete it first" in error, error
        assert files_under(mine) == {"thesis.tex": b"years of work"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_an_earlier_export_and_an_empty_folder_are_replaced(run_folder, tmp_path, capsys):
    step = run_folder / "checkpoint" / "step-20"
    out = tmp_path / "out"
    out.mkdir()  # empty
    assert convert_main([str(step), str(out)]) == 0
    first = files_under(out)
    assert EXPORT_MARKER in first and "model.safetensors" in first
    (out / "stale.safetensors").write_bytes(b"from an earlier export")
    assert convert_main([str(step), str(out)]) == 0  # over an export of ours
    assert files_under(out) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("beside", [".tmp", ".old"])
def test_a_folder_of_the_users_beside_the_output_is_never_deleted(run_folder, tmp_path, capsys, beside):
    """`<out>.tmp` / `<out>.old` are where an export writes and where it sets the old folder aside: a folder of
    the user's under that name is refused, as is a plain file there; a leftover of an export of ours is deleted."""
    step = run_folder / "checkpoint" / "step-20"
    theirs = tmp_path / f"out{beside}"
    theirs.mkdir()
    (theirs / "data.csv").write_text("1,2,3")
    assert convert_main([str(step), str(tmp_path / "out")]) == 2
    error = one_error(capsys)
    assert str(theirs) in error and "move it away" in error, error
    assert files_under(theirs) == {"data.csv": b"1,2,3"} and not (tmp_path / "out").exists()

    (theirs / "data.csv").unlink()
    theirs.rmdir()
    theirs.write_text("a file")
    assert convert_main([str(step), str(tmp_path / "out")]) == 2
    assert str(theirs) in one_error(capsys) and theirs.read_text() == "a file"

    theirs.unlink()
    theirs.mkdir()
    (theirs / EXPORT_MARKER).write_text("")  # what an interrupted export of ours leaves
    (theirs / "model.safetensors").write_bytes(b"partial")
    assert convert_main([str(step), str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_the_end_of_run_export_refuses_a_folder_of_other_files_on_every_rank(tmp_path):
    """export_hf (the trainer's end-of-run export) goes through the same check, before anything is written, as one
    CheckpointError every rank raises (train.py: exit 2, one line); check_hf_export_folder asks it up front."""
    mine = tmp_path / "hf"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match=f"no {EXPORT_MARKER}") as refused:
        check_hf_export_folder(mine)
    assert refused.value.every_rank and str(mine) in str(refused.value)
    with pytest.raises(CheckpointError, match=f"no {EXPORT_MARKER}") as refused:
        export_hf(initialized_model(ARGS), ARGS, str(mine), torch.bfloat16)
    assert refused.value.every_rank
    assert files_under(tmp_path) == {"hf/keep.txt": b"mine"}

    (mine / "keep.txt").unlink()
    check_hf_export_folder(mine)  # empty: would be written
    export_hf(initialized_model(ARGS), ARGS, str(mine), torch.bfloat16)
    check_hf_export_folder(mine)  # an export of ours: would be replaced
    with pytest.raises(CheckpointError, match="holds the checkpoint"):
        check_hf_export_folder(tmp_path, source=tmp_path / "checkpoint" / "step-2")


def test_a_run_whose_export_would_delete_a_folder_of_the_users_exits_2_with_one_line_and_keeps_it(tmp_path, capsys):
    """The trainer's end-of-run export into <dump_folder>/hf, with a folder of the user's at hf.tmp beside it."""
    from harness.train import main

    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "hf.tmp").mkdir()
    (tmp_path / "hf.tmp" / "keep.txt").write_text("mine")
    capsys.readouterr()
    assert main(["--config", str(repo / "train_configs" / "debug_model.toml"), "--training.steps", "1",
                 "--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.enable_tensorboard",
                 "false", "--checkpoint.export_hf_at_end", "true", "--job.dump_folder", str(tmp_path)]) == 2
    error = one_error(capsys, logged=True)
    assert str(tmp_path / "hf.tmp") in error and "move it away" in error, error
    assert files_under(tmp_path / "hf.tmp") == {"keep.txt": b"mine"} and not (tmp_path / "hf").exists()


def test_a_missing_step_folder_is_named_as_missing(tmp_path, capsys):
    """Before: "has no .metadata", as if the folder were there."""
    assert convert_main([str(tmp_path / "checkpoint" / "step-300"), str(tmp_path / "out")]) == 2
    assert one_error(capsys) == f"error: {tmp_path / 'checkpoint' / 'step-300'}: no such folder"
