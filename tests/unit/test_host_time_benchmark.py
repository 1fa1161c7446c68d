"""benchmarks/host_time.py: timers count each part once (a part called inside another counts in the outer one), per
step, the step's rest is what its parts leave, and the pace is the steps' spacing; every part it times exists in the
installed torch and here."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("host_time", REPO / "benchmarks" / "host_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parts_are_counted_once_per_step_and_the_rest_is_what_they_leave():
    host_time = _module()
    inner = host_time._timed("inner", lambda: time.sleep(0.02))
    outer = host_time._timed("outer", lambda: (time.sleep(0.03), inner()))
    between = host_time._timed("check (between steps)", lambda: time.sleep(0.01))
    detail = host_time._timed_detail("finer", lambda: time.sleep(0.005))
    recursive = host_time._timed_detail("finer", lambda: (time.sleep(0.005), detail()))

    def step():
        outer()  # 50 ms, all of it the outer part's
        inner()  # 20 ms
        time.sleep(0.04)  # the rest
        recursive()  # 10 ms of the rest, also reported as a detail, once

    step = host_time._timed_step(step)
    for _ in range(3):
        between()
        step()
    lines = host_time.report(warmup=1)
    assert "2 steps" in lines[0]
    ms = {line.split("ms  ")[1].split(" (3 calls")[0]: float(line.split(":")[1].split("ms")[0]) for line in lines[1:]}
    total = float(lines[0].split("queueing a step ")[1].split(" ms")[0])
    assert set(ms) == {"outer", "inner", "check (between steps)", "the rest of the step", "within: finer"}
    assert 10 <= ms["within: finer"] < 20 and lines[-1].endswith("(3 calls in all)")  # the recursion once
    # sleeps last at least as asked, and a loaded CI machine may add a few ms to each
    assert 50 <= ms["outer"] < 65 and 20 <= ms["inner"] < 35 and 10 <= ms["check (between steps)"] < 25
    assert 50 <= ms["the rest of the step"] < 70
    pace = float(lines[0].split("one every ")[1].split(" ms")[0])  # the step and the part between steps
    assert 130 <= pace < 170 and pace > total
    assert abs(total - ms["outer"] - ms["inner"] - ms["the rest of the step"]) < 0.1  # (as printed: 1-2 decimals)


def test_every_timed_part_exists():
    for owner, name, _ in _module()._parts():
        assert name in owner.__dict__, f"{owner.__name__}.{name}"


def test_the_fsdp_details_exist():
    """The finer timers skip what a torch lacks; FSDP2's must exist in the installed one (they name private code)."""
    found = {detail for _, _, detail in _module()._details()}
    assert sum(detail.startswith("FSDP") for detail in found) == 7, found
