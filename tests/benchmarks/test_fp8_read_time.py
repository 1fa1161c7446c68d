"""benchmarks/tools/fp8_read_time.py on a tiny FP8 release folder (CPU only: the host's pass alone): it reads the
tensors of the layers asked for, and the ones outside the layers, and prints them equal to the host's."""

from __future__ import annotations

import re

import torch

from harness.checkpoint.hf_weights import export_hf, hf_native_tensors
from models.qwen35_moe import get_flavor
from tests.benchmarks.scripts import printed_by
from tests.builders import fp8_release_folder, initialized_model


def test_the_read_time_tool_reads_the_layers_asked_for(tmp_path):
    flavor = get_flavor("debugmodel")
    export_hf(initialized_model(flavor, 0), flavor, str(tmp_path / "fp32"), torch.float32)
    folder = fp8_release_folder(tmp_path / "fp32", tmp_path / "fp8")
    shapes, _ = hf_native_tensors(folder, flavor)
    outside = sum(not k.startswith("layers.") for k in shapes)
    first = sum(k.startswith("layers.0.") for k in shapes)
    assert outside and first
    out = printed_by("tools/fp8_read_time.py", str(folder), "--layers", "1")
    count = re.search(r"^cpu: (\d+) tensors .*equal to the host's: True$", out, re.M)
    assert count is not None, out
    assert int(count.group(1)) == outside + first
