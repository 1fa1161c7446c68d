"""Old key names and values (harness/config/renamed.py) still run: read as their new ones, each with one notice line
naming the new key, in config files (a saved config.toml included) and on the command line; a checkpoint's saved run
config is compared under the new names."""

from __future__ import annotations

import copy
import json
import tomllib

import pytest

import harness.config.renamed as renamed
from harness.config import ConfigError, JobConfig, load_config, to_toml
from harness.config.help import config_help
from harness.config.resume import data_changes, other_changes

# old key -> (its new key, a value other than the default)
OLD_KEYS = {
    "training.dataset": ("training.dataset_source", "parquet"),
    "validation.dataset": ("validation.dataset_source", "parquet"),
    "training.data_format": ("training.dataset_content", "chat"),
    "model.router_force_balance": ("debug.moe_force_load_balance", True),
}


@pytest.fixture(autouse=True)
def fresh_notices(monkeypatch):
    """Each test sees the notices its own loads print (a process prints each one once)."""
    monkeypatch.setattr(renamed, "_shown", set())
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("QWEN35_EXIT_DIR", raising=False)


def value_of(cfg: JobConfig, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def toml_value(value) -> str:
    return json.dumps(value)  # a TOML string or bool


def test_every_renamed_key_is_covered_here():
    assert set(OLD_KEYS) == set(renamed.RENAMED_KEYS)
    assert {new for new, _ in OLD_KEYS.values()} == set(renamed.RENAMED_KEYS.values())


@pytest.mark.parametrize("old", OLD_KEYS)
def test_an_old_key_in_a_file_sets_the_new_one_with_one_notice(tmp_path, capsys, old):
    new, value = OLD_KEYS[old]
    section, name = old.split(".")
    path = tmp_path / "old.toml"
    path.write_text(f"[{section}]\n{name} = {toml_value(value)}\n")
    cfg = load_config(["--config", str(path)])
    assert value_of(cfg, new) == value
    assert capsys.readouterr().err.splitlines() == [
        f"notice: {path}: {old} is now {new} (the old name still works; rename it)"]


@pytest.mark.parametrize("old", OLD_KEYS)
def test_an_old_key_on_the_command_line_sets_the_new_one_with_one_notice(capsys, old):
    new, value = OLD_KEYS[old]
    cfg = load_config([f"--{old}", str(value).lower()])
    assert value_of(cfg, new) == value
    assert capsys.readouterr().err.splitlines() == [
        f"notice: command line: {old} is now {new} (the old name still works; rename it)"]


def test_model_name_is_accepted_ignored_and_named_as_no_longer_read(tmp_path, capsys):
    path = tmp_path / "titan.toml"
    path.write_text('[model]\nname = "llama3"\nflavor = "debugmodel"\n')
    assert load_config(["--config", str(path)]) == JobConfig()
    assert load_config(["--model.name", "anything"]) == JobConfig()
    notices = capsys.readouterr().err.splitlines()
    assert len(notices) == 2 and all("model.name is no longer read" in line and "remove it" in line
                                     for line in notices), notices


def test_reshard_default_is_read_as_always(tmp_path, capsys):
    path = tmp_path / "reshard.toml"
    path.write_text('[parallelism]\nfsdp_reshard_after_forward = "default"\n')
    assert load_config(["--config", str(path)]).parallelism.fsdp_reshard_after_forward == "always"
    assert load_config(["--parallelism.fsdp_reshard_after_forward", "default"]).parallelism.fsdp_reshard_after_forward \
        == "always"
    notices = capsys.readouterr().err.splitlines()
    assert len(notices) == 2 and all("fsdp_reshard_after_forward = 'default' is now 'always'" in line
                                     for line in notices), notices
    with pytest.raises(ConfigError, match="one of always|never|auto"):
        load_config(["--parallelism.fsdp_reshard_after_forward", "sometimes"])


def test_a_config_toml_saved_under_the_old_names_loads_as_the_new_one(tmp_path, capsys):
    """What an earlier version wrote to <dump_folder>/config.toml: every key under its old name."""
    cfg = load_config(["--training.dataset_source", "jsonl", "--training.dataset_content", "chat",
                       "--debug.moe_force_load_balance", "true", "--parallelism.fsdp_reshard_after_forward", "always",
                       "--validation.dataset_source", "parquet"])
    saved_now, saved_before = tmp_path / "config.toml", tmp_path / "config-before.toml"
    saved_now.write_text(to_toml(cfg))
    old = under_old_names(tomllib.loads(saved_now.read_text()))
    saved_before.write_text("".join(f"[{section}]\n" + "".join(f"{key} = {json.dumps(value)}\n"
                                                               for key, value in keys.items())
                                    for section, keys in old.items()))
    assert load_config(["--config", str(saved_before)]) == load_config(["--config", str(saved_now)])
    assert len(capsys.readouterr().err.splitlines()) == len(OLD_KEYS) + 2  # + model.name, + "default"


def test_an_old_name_beside_its_new_one_in_one_file_is_a_problem_naming_both(tmp_path):
    path = tmp_path / "both.toml"
    path.write_text('[training]\ndataset = "jsonl"\ndataset_source = "text"\n')
    with pytest.raises(ConfigError) as e:
        load_config(["--config", str(path)])
    assert e.value.problems == [f"{path}: training.dataset and training.dataset_source are one key, "
                                f"training.dataset_source; keep training.dataset_source alone"]


@pytest.mark.parametrize("old", OLD_KEYS)
def test_an_old_name_beside_its_new_one_on_the_command_line_is_a_problem_naming_both(old):
    """Before, the last one silently won (the same pair in a file was refused). The same key twice under one name
    stays an override, the last one winning, as on any command line."""
    new, value = OLD_KEYS[old]
    flags = [f"--{new}", str(value).lower(), f"--{old}", str(value).lower(), f"--{new}", str(value).lower()]
    with pytest.raises(ConfigError) as e:
        load_config(flags)
    assert e.value.problems == [f"command line: --{new} and --{old} are one key, {new}; keep --{new} alone"]
    assert value_of(load_config([f"--{new}", "text" if "source" in new else str(value).lower(), f"--{new}",
                                 str(value).lower()]), new) == value


def test_a_bad_value_under_an_old_name_is_named_as_written_and_no_notice_is_printed(capsys):
    with pytest.raises(ConfigError) as e:
        load_config(["--training.dataset", "csv"])
    assert e.value.problems == ["command line: training.dataset = 'csv' is not one of text|jsonl|parquet|hf"]
    assert capsys.readouterr().err == ""  # the error line alone: the notice comes once the config loads


def test_notices_are_printed_once_per_process_and_by_rank_0_alone(capsys, monkeypatch):
    load_config(["--training.dataset", "jsonl"])
    load_config(["--training.dataset", "jsonl"])
    assert len(capsys.readouterr().err.splitlines()) == 1
    monkeypatch.setattr(renamed, "_shown", set())
    monkeypatch.setenv("RANK", "1")
    load_config(["--training.dataset", "jsonl"])
    assert capsys.readouterr().err == ""


def test_help_lists_the_new_names_as_keys_and_the_old_ones_apart():
    text = config_help([])
    keys = [line.split()[0] for line in text.splitlines() if line.startswith("  --") and "  (" in line]
    for old, (new, _) in OLD_KEYS.items():
        assert f"--{new}" in keys and f"--{old}" not in keys
        assert f"  --{old}  now --{new}" in text
    assert "--model.name" not in keys and "--model.name  no longer read" in text


# --- a checkpoint's run config saved under the old names (what harness/checkpoint/checkpointer.py compares) ------


def under_old_names(config: dict) -> dict:
    """A run config ({section: {key: value}}, as `JobConfig.to_dict()` or a config.toml holds it) as an earlier
    version wrote it."""
    saved = copy.deepcopy(config)
    for old, (new, _) in OLD_KEYS.items():
        new_section, new_name = new.split(".")
        old_section, old_name = old.split(".")
        saved[old_section][old_name] = saved[new_section].pop(new_name)
    del saved["debug"]  # a section the earlier version did not have
    saved["model"]["name"] = "qwen35_moe"
    if saved["parallelism"]["fsdp_reshard_after_forward"] == "always":
        saved["parallelism"]["fsdp_reshard_after_forward"] = "default"
    return saved


def test_a_run_config_saved_under_old_names_compares_equal_to_the_same_run_now():
    cfg = load_config(["--training.dataset_source", "jsonl", "--parallelism.fsdp_reshard_after_forward", "always",
                       "--debug.moe_force_load_balance", "true"])
    saved = under_old_names(cfg.to_dict())
    assert "dataset" in saved["training"] and "dataset_source" not in saved["training"]
    assert data_changes(saved, cfg.to_dict()) == []
    assert other_changes(saved, cfg) == []


def test_a_change_under_an_old_name_is_named_under_the_new_one():
    before = load_config(["--training.dataset_source", "jsonl"])
    now = load_config(["--training.dataset_source", "parquet", "--training.dataset_content", "chat",
                       "--debug.moe_force_load_balance", "true", "--parallelism.fsdp_reshard_after_forward", "never"])
    saved = under_old_names(before.to_dict())
    assert data_changes(saved, now.to_dict()) == ["training.dataset_source 'jsonl' -> 'parquet'",
                                                  "training.dataset_content 'text' -> 'chat'"]
    assert other_changes(saved, now) == ["parallelism.fsdp_reshard_after_forward 'auto' -> 'never'",
                                         "debug.moe_force_load_balance False -> True"]
