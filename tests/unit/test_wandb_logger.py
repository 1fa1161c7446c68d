"""Weights & Biases logging (`metrics.enable_wandb`), offline: a short training run writes a W&B run whose history
holds metrics.jsonl's values step for step, under the run's id, project and config, and a resumed launch logs to the
same run id; without wandb installed the run is refused before it starts; nothing imports wandb unless a run asks."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from harness.train import main

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "train_configs" / "debug_model.toml")
CORPUS = str(REPO / "data" / "debug_corpus" / "train.jsonl")
FAST = ["--config", CONFIG, "--training.seq_len", "64", "--training.local_batch_size", "4",
        "--metrics.enable_tensorboard", "false", "--checkpoint.export_hf_at_end", "false",
        "--training.dataset_path", CORPUS, "--job.name", "wandb_test"]
VALIDATION = ["--validation.enable", "true", "--validation.dataset_path", CORPUS, "--validation.steps", "1",
              "--validation.freq", "2"]


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, every folder of its own under tmp_path: nothing is sent, nothing lands in the home folder."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))


def offline_runs(dump: Path) -> list[dict]:
    """Each offline W&B run under `dump` (in the order they started): its id, project, config, history by step and
    whether it ended, read from its transaction log (<dump>/wandb/offline-run-*/run-<id>.wandb)."""
    import wandb

    # wandb's service writes a run's log from a buffer, which `finish()` may return before it is written: once in the
    # whole suite, under load, both runs of one test process read back without their run record, never since, nor
    # alone under load. Stopping the service (as a process's exit does) writes every log whole.
    wandb.teardown()
    return [_read_run(path) for path in sorted(dump.glob("wandb/offline-run-*/run-*.wandb"))]


def _read_run(path: Path) -> dict:
    """An offline run's transaction log: LevelDB's log format (what `wandb sync` reads) after a 7-byte file header
    (":W&B", magic, version): 32 KiB blocks of records, each a 7-byte header (crc32c, length, type: 1 whole, 2 first,
    3 middle, 4 last piece) and its bytes, a block's tail too short for a header left as padding; the pieces joined
    are a protobuf Record."""
    from wandb.proto.wandb_internal_pb2 import Record

    block, header = 32768, 7
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    run, pos, pieces = {"history": {}, "ended": False}, header, b""
    while pos + header <= len(data):
        if block - pos % block < header:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        pieces, pos = pieces + data[pos + header:pos + header + length], pos + header + length
        if kind not in (1, 4):
            continue
        record = Record()
        record.ParseFromString(pieces)
        pieces = b""
        if record.HasField("run"):
            config = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                      for item in record.run.config.update}
            run.update(id=record.run.run_id, project=record.run.project, config=config)
        elif record.HasField("history"):
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            run["history"].setdefault(row["_step"], {}).update(row)
        elif record.HasField("exit"):
            run["ended"] = True
    return run


def _records(dump: Path) -> dict[int, dict]:
    records = {}
    for line in (dump / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        records.setdefault(record["step"], {}).update(record)
    return records


def test_a_run_logs_its_metrics_to_an_offline_wandb_run(tmp_path, offline_wandb):
    dump = tmp_path / "out"
    assert main([*FAST, *VALIDATION, "--training.steps", "3", "--metrics.enable_wandb", "true",
                 "--job.dump_folder", str(dump)]) == 0
    [run] = offline_runs(dump)
    assert run["ended"]  # finished by the logger's close: the log is whole
    line = json.loads((dump / "run.json").read_text())["run"]
    assert (run["id"], run["project"]) == (line, "wandb_test")
    assert run["config"]["training"]["steps"] == 3 and run["config"]["metrics"]["enable_wandb"] is True

    records = _records(dump)
    assert sorted(run["history"]) == sorted(records) == [1, 2, 3]
    for step, record in records.items():
        logged = run["history"][step]
        for key, value in record.items():  # the same floats: each a JSON number of the same Python float
            if key != "step" and value is not None:
                assert logged[key] == value, (step, key)
    assert "val_loss" in records[2] and "val_loss" in records[3]  # validation steps came through too


def test_a_resumed_launch_logs_to_the_same_wandb_run(tmp_path, offline_wandb):
    dump = tmp_path / "out"
    flags = [*FAST, "--metrics.enable_wandb", "true", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
             "--job.dump_folder", str(dump)]
    assert main([*flags, "--training.steps", "2"]) == 0
    assert main([*flags, "--training.steps", "3"]) == 0  # resumes from step 2
    first, resumed = offline_runs(dump)  # offline, each launch writes its own folder; `wandb sync` joins them
    assert first["ended"] and resumed["ended"]
    assert first["id"] == resumed["id"] == json.loads((dump / "run.json").read_text())["run"]
    assert sorted(first["history"]) == [1, 2] and sorted(resumed["history"]) == [3]
    assert resumed["history"][3]["loss"] == _records(dump)[3]["loss"]


def test_without_wandb_installed_the_run_is_refused_before_it_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    dump = tmp_path / "out"
    assert main([*FAST, "--training.steps", "1", "--metrics.enable_wandb", "true",
                 "--job.dump_folder", str(dump)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert "metrics.enable_wandb is true but wandb is not installed: pip install wandb" in err
    assert not dump.exists()  # nothing written


def test_nothing_imports_wandb_unless_a_run_asks_for_it(tmp_path):
    """The harness's modules, a config's validation and the metrics logger, in a fresh interpreter: wandb stays
    unimported (~0.5 s, and a service process, for runs that never use it)."""
    script = f"""
import sys
import harness.evaluate, harness.metrics, harness.plot, harness.train, harness.trainer, harness.wandb_logger
from harness.config import load_config
from tests.runs import run_requirements_error
from harness.metrics import MetricsLogger

run_requirements_error(load_config({[*FAST, "--job.dump_folder", str(tmp_path / "out")]!r}))
logger = MetricsLogger({str(tmp_path / "out")!r}, 1, enable_tensorboard=False, tb_folder="tb", run_id="run")
logger.log(1, {{"loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_sec": 1.0, "mfu": None, "max_memory_gib": 0.1}})
logger.close()
assert "wandb" not in sys.modules, "wandb was imported"
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
