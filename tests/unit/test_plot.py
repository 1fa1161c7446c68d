"""`python -m harness.plot`: a PNG of a run's metrics.jsonl (as MetricsLogger writes it), one panel per metric, of
the stated size; damaged lines are skipped and counted; bad input and a missing matplotlib exit 2 in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from PIL import Image

from harness.metrics import MetricsLogger
from harness.plot import DPI, PANEL_HEIGHT_IN, WIDTH_IN, main

FIRST_LINE_COLOR = (0x1F, 0x77, 0xB4)  # matplotlib's default "C0": the first line of every panel


def _run_metrics(folder: Path, steps: int = 20, tokens_per_sec: bool = True) -> Path:
    """A metrics.jsonl written by the harness's own logger: training steps, and validation every 5 steps."""
    logger = MetricsLogger(folder, steps, enable_tensorboard=False, tb_folder="tb", run_id="run")
    for step in range(1, steps + 1):
        logger.log(step, {"loss": 5.0 / step, "mtp_loss": 6.0 / step, "grad_norm": 1.0 + step % 3,
                          "lr": 1e-3 * min(step, 5) / 5, "tokens_per_sec": 1000.0 + step, "mfu": None,
                          "max_memory_gib": 0.5})
        if step % 5 == 0:
            logger.log_validation(step, {"val_loss": 5.5 / step, "val_tokens": 100})
    logger.close()
    path = folder / "metrics.jsonl"
    if not tokens_per_sec:
        path.write_text(path.read_text().replace('"tokens_per_sec"', '"other"'))
    return path


def _panels_drawn(png: Path, panels: int) -> None:
    """The PNG decodes, is WIDTH_IN x PANEL_HEIGHT_IN inches a panel at DPI, and each panel's band holds a line."""
    with Image.open(png) as image:
        image.load()  # decodes every pixel: a truncated or corrupt file raises
        assert image.format == "PNG"
        assert image.size == (WIDTH_IN * DPI, int(PANEL_HEIGHT_IN * DPI) * panels)
        pixels = image.convert("RGB")
    band = image.size[1] // panels
    for panel in range(panels):
        colors = {pixels.getpixel((x, y)) for x in range(0, image.size[0], 2)
                  for y in range(panel * band, (panel + 1) * band, 2)}
        assert FIRST_LINE_COLOR in colors, f"panel {panel} draws no line"


def test_a_run_plots_loss_lr_grad_norm_and_tokens_per_second(tmp_path, capsys):
    _run_metrics(tmp_path)
    assert main([str(tmp_path)]) == 0
    assert f"wrote {tmp_path / 'metrics.png'} (4 panels, 24 records)" in capsys.readouterr().out
    _panels_drawn(tmp_path / "metrics.png", panels=4)


def test_damaged_lines_are_skipped_and_counted(tmp_path, capsys):
    path = _run_metrics(tmp_path, tokens_per_sec=False)
    lines = path.read_bytes().splitlines(keepends=True)
    lines[3] = lines[3][:20] + b"\n"  # cut by a kill
    lines.insert(6, b"\xff\xfe not text\n")
    lines.insert(9, b'{"loss": 1.0}\n')  # no step
    path.write_bytes(b"".join(lines))
    out = tmp_path / "elsewhere.png"
    assert main([str(tmp_path), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"warning: skipped 3 damaged line(s) of {path}" in captured.err
    assert "(3 panels, 23 records)" in captured.out
    _panels_drawn(out, panels=3)


@pytest.mark.parametrize("case, message", [
    ("missing folder", "does not exist"),
    ("no metrics.jsonl", "holds no metrics.jsonl"),
    ("nothing readable", "holds no readable record"),
    ("unwritable output", "No such file or directory"),
])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, capsys, case, message):
    folder = tmp_path / "run"
    folder.mkdir()
    argv = [str(folder)]
    if case == "missing folder":
        argv = [str(tmp_path / "nothing")]
    elif case == "nothing readable":
        (folder / "metrics.jsonl").write_text("{\n")
    elif case == "unwritable output":
        _run_metrics(folder)
        argv += ["--out", str(tmp_path / "no" / "such" / "folder.png")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err
    assert all(line.startswith("warning: ") for line in err[:-1])


def test_without_matplotlib_it_names_the_extra(tmp_path, capsys, monkeypatch):
    _run_metrics(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == ("error: harness.plot needs matplotlib, which is not installed: "
                                               "pip install -e '.[plot]'")
    assert not (tmp_path / "metrics.png").exists()
