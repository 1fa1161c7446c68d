"""What the tests read from a training run's outputs and inputs and write as its inputs: plain functions, no
fixtures."""

from __future__ import annotations

import json
from pathlib import Path


def losses(dump: Path) -> dict[int, float]:
    """The loss of every logged step of the run that dumped to `dump`, by step (its metrics.jsonl)."""
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def write_rows(path: Path, rows: list[dict]) -> Path:
    """`rows` as a JSON-lines dataset at `path`."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_requirements_error(cfg) -> None:
    """A ConfigError naming every problem of `cfg`'s values and of what its run reads (no world size: no layout), as a
    launch's check names them."""
    from harness.config import ConfigError, config_problems

    problems = config_problems(cfg, run_requirements=True)
    if problems:
        raise ConfigError(problems)


def open_documents(kind: str, path: str, text_field: str = "text"):
    """An iterator over the documents of one source (one full pass), Skipped for rows whose text is null, read as
    the token cache's build reads them (work units in order); errors about the path are raised here."""
    import itertools

    from harness.data.sources import SOURCE_SUFFIXES, check_source, hf_documents, read_unit, source_files, source_units

    check_source(kind, path)
    if kind == "hf":
        return hf_documents(path, text_field)
    units = source_units(kind, source_files(Path(path), SOURCE_SUFFIXES[kind]))
    return itertools.chain.from_iterable(read_unit(kind, unit, text_field) for unit in units)
