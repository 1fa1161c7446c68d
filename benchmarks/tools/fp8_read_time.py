"""How long reading an FP8 release folder's weights dequantized takes, the dequantization on the host (fp32, as the
converter reads) against on the GPU (as a run on the GPU loads: checkpoint.initial_load_hf with the base not held in
FP8, a full fine-tune or `lora.fp8_base dequantized`): every native tensor of the first `--layers` layers read
whole (the experts fused) through hf_native_tensors, the same keys on each device, and the time of all of them on the
GPU. Each device's result is checked equal to the host's, bit for bit.

    python benchmarks/tools/fp8_read_time.py /dev/shm/fp8 --layers 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from harness.checkpoint.hf_weights import hf_native_tensors  # noqa: E402
from models.qwen35_moe import Qwen35MoeArgs  # noqa: E402


def read_all(read, keys: list[str], device: torch.device) -> tuple[float, list[torch.Tensor]]:
    """Seconds to read `keys` (each ended on `device`), and the tensors, moved to the host."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = [read(key) for key in keys]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, [t.cpu() for t in out]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--layers", type=int, default=2, help="layers read on both devices (the host's pass is slow)")
    ns = parser.parse_args()
    args = Qwen35MoeArgs.from_hf_config(ns.folder)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    readers = {d: hf_native_tensors(ns.folder, args, d) for d in devices}
    shapes = readers[devices[0]][0]
    some = [k for k in shapes if not k.startswith("layers.") or int(k.split(".")[1]) < ns.layers]
    reference = None
    for device in devices:
        seconds, tensors = read_all(readers[device][1], some, device)
        if reference is None:
            reference, base = tensors, seconds
        same = all(torch.equal(a, b) for a, b in zip(tensors, reference))
        print(f"{device.type}: {len(some)} tensors ({sum(t.numel() for t in tensors) / 1e9:.2f}B values) in "
              f"{seconds:.2f} s ({base / seconds:.2f}x the host's); equal to the host's: {same}")
        if not same:
            return 1
    if torch.device("cuda") in readers:
        seconds, _ = read_all(lambda k: readers[torch.device("cuda")][1](k).sum(), list(shapes), torch.device("cuda"))
        print(f"cuda: all {len(shapes)} tensors in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
