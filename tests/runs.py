"""What the tests read from a training run's outputs and write as its inputs: plain functions, no fixtures."""

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
