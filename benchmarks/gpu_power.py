"""The GPUs' power draw and SM clocks while a benchmark runs, sampled by nvidia-smi every 250 ms.

On an H200 at 35B-A3B widths our training step runs at the GPU's software power cap (docs/performance.md, "How to
read them"): the GEMMs then slow down as memory-bound kernels are taken out, and two hosts of one kind run the same
code a few percent apart. The benchmarks print these figures next to tokens/s so a result can be read against
them.

    with PowerSampler() as power:
        ...                      # the run
    print(*power.summary(), sep="\n")
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile

QUERY = "index,clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_throttle_reasons.sw_power_cap"


class PowerSampler:
    """Runs nvidia-smi in the background for the duration of a `with` block; nothing where there is none."""

    def __init__(self, interval_ms: int = 250):
        self.interval_ms = interval_ms
        self.lines: list[str] = []
        self._proc = self._out = None

    def __enter__(self) -> PowerSampler:
        if shutil.which("nvidia-smi") is not None:
            self._out = tempfile.TemporaryFile(mode="w+")
            self._proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)],
                stdout=self._out, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._out.seek(0)
            self.lines = self._out.read().splitlines()
            self._out.close()

    def summary(self) -> list[str]:
        return summarize(self.lines)


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]" and the like
        return None


def summarize(lines: list[str], busy_fraction: float = 0.4) -> list[str]:
    """One line per GPU from nvidia-smi's CSV samples (QUERY, no header or units), over its busy samples: those
    drawing at least `busy_fraction` of its power limit (compile, data loading and idle ones left out)."""
    per_gpu: dict[str, list[tuple[float, float, float, float, bool]]] = {}
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 6:
            continue
        clock, max_clock, power, limit = (_number(f) for f in fields[1:5])
        if None in (clock, max_clock, power, limit):
            continue
        per_gpu.setdefault(fields[0], []).append((clock, max_clock, power, limit, fields[5] == "Active"))
    out = []
    for gpu, samples in sorted(per_gpu.items()):
        busy = [s for s in samples if s[2] >= busy_fraction * s[3]]
        if not busy:
            continue
        mean = lambda i: sum(s[i] for s in busy) / len(busy)  # noqa: E731
        capped = sum(s[4] for s in busy) / len(busy)
        out.append(f"GPU {gpu}: {len(busy)} busy samples: SM clock {mean(0):,.0f} of {busy[0][1]:,.0f} MHz, power "
                   f"{mean(2):,.0f} of {busy[0][3]:,.0f} W, power cap active in {capped:.0%}")
    return out
