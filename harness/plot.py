"""Plot a run's metrics.jsonl into one PNG: loss (with val_loss and mtp_loss where logged), lr, grad_norm, and
tokens/s where logged, one panel each over the steps.

    python -m harness.plot DUMP_FOLDER [--out FILE.png]      # default DUMP_FOLDER/metrics.png

Needs matplotlib, an optional dependency: pip install -e '.[plot]'. A damaged line of metrics.jsonl (cut by a kill,
not JSON, without a step) is skipped and counted on stderr. Exit codes: 0 written, 2 bad input (one `error:` line: a
missing folder or metrics.jsonl, a file without one readable record, an output path that cannot be written, or no
matplotlib).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from .cli_parser import OneLineParser

# (panel title, the keys drawn in it): a panel is drawn when a record holds one of its keys
PANELS = (("loss", ("loss", "val_loss", "mtp_loss", "val_mtp_loss")), ("lr", ("lr",)), ("grad_norm", ("grad_norm",)),
          ("tokens/s", ("tokens_per_sec",)))
WIDTH_IN, PANEL_HEIGHT_IN, DPI = 10, 2.5, 100  # each panel 1000 x 250 pixels


class PlotError(ValueError):
    """Bad input: the message names the folder or file at fault."""


def read_records(path: Path) -> tuple[list[dict], int]:
    """(the records of a metrics.jsonl, the number of damaged lines skipped)."""
    records, damaged = [], 0
    for line in path.read_bytes().splitlines():
        record = _record(line)
        if record is not None:
            records.append(record)
        elif line.strip():
            damaged += 1
    return records, damaged


def _record(line: bytes) -> dict | None:
    """The JSON object of a line with an integer step, or None: a line cut by a kill, a flipped byte, an edit."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return record if isinstance(step, int) and not isinstance(step, bool) else None


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key`, where a record holds a finite number for it."""
    points = [(r["step"], r[key]) for r in records
              if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool) and math.isfinite(r[key])]
    return [s for s, _ in points], [v for _, v in points]


def plot(records: list[dict], out: Path) -> int:
    """Write the panels of `records` as a PNG at `out`; returns the number of panels."""
    import matplotlib

    matplotlib.use("Agg")  # no display: a file only, on any machine
    import matplotlib.pyplot as plt

    panels = [(title, keys) for title, keys in PANELS if any(_series(records, key)[0] for key in keys)]
    if not panels:
        raise PlotError("its records hold none of " + ", ".join(k for _, keys in PANELS for k in keys))
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False,
                             figsize=(WIDTH_IN, PANEL_HEIGHT_IN * len(panels)), dpi=DPI)
    for ax, (title, keys) in zip(axes[:, 0], panels):
        for key in keys:
            steps, values = _series(records, key)
            if steps:  # validation records are sparse: markers show each one
                ax.plot(steps, values, label=key, marker="o" if key.startswith("val_") else None, markersize=3)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        if len(ax.get_lines()) > 1:
            ax.legend(loc="upper right")
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    try:
        fig.savefig(out, format="png", dpi=DPI)
    finally:
        plt.close(fig)
    return len(panels)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m harness.plot", help_command="python -m harness.plot --help",
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("dump_folder", help="a run's dump folder, holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="the PNG to write (default DUMP_FOLDER/metrics.png)")
    args = parser.parse_args(argv)
    folder = Path(args.dump_folder)
    path, out = folder / "metrics.jsonl", Path(args.out) if args.out else folder / "metrics.png"
    try:
        import matplotlib  # noqa: F401 - the optional dependency, named before any work
    except ImportError:
        print("error: harness.plot needs matplotlib, which is not installed: pip install -e '.[plot]'",
              file=sys.stderr)
        return 2
    try:
        if not folder.is_dir():
            raise PlotError(f"dump folder {folder} does not exist")
        if not path.is_file():
            raise PlotError(f"{folder} holds no metrics.jsonl: is it a run's dump folder?")
        records, damaged = read_records(path)
        if damaged:
            print(f"warning: skipped {damaged} damaged line(s) of {path}", file=sys.stderr)
        if not records:
            raise PlotError(f"{path} holds no readable record")
        try:
            panels = plot(records, out)
        except PlotError as e:
            raise PlotError(f"{path}: {e}") from None
    except (PlotError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({panels} panels, {len(records)} records)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
