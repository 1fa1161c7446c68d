"""Peak host memory of the HF import, the end-of-run export and the offline converter, against the model size.

    python benchmarks/hf_io_memory.py [--layers 4] [--experts 8] [--max-shard-gib 1] [--workdir /tmp/hf_io]

Builds a 35B-A3B-wide model (vocab 248,320, hidden 2048) cut to a few layers and experts (about 1.2B parameters
by default), in fp32 on CPU, saves it as a DCP checkpoint, then measures in fresh processes (peak resident set
size, ru_maxrss):
  export   the model in memory (fp32) exported to HF in bf16 by harness.checkpoint.hf_weights.export_hf
  convert  python -m harness.convert on the DCP step (reads the weights shard by shard)
  import   an empty model filled from the HF folder by harness.checkpoint.hf_weights.load_hf_weights
The peak is taken over the stage alone (Linux: the high-water mark is reset once the model is built), and
reported with the memory the process must hold anyway (the model's parameters, or nothing for the converter)
subtracted, next to the model's bf16 size: every stage should stay within a few times its largest tensor
(the embedding: 0.95 GiB in bf16, 1.9 GiB in fp32), whatever the model's size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

GIB = 1024**3


def model_args(layers: int, experts: int):
    from models.qwen35_moe import Qwen35MoeArgs

    return Qwen35MoeArgs(num_hidden_layers=layers, num_experts=experts, num_experts_per_tok=min(8, experts))


def build(layers: int, experts: int):
    import torch

    from models.qwen35_moe import Qwen35MoeModel

    with torch.device("meta"):
        model = Qwen35MoeModel(model_args(layers, experts))
    model.to_empty(device="cpu")
    return model


def reset_peak_rss() -> None:
    """Start the high-water mark of resident memory afresh (Linux >= 4.0: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def stage(name: str, work: Path, layers: int, experts: int, shard_gib: float) -> dict:
    """Runs in a fresh process; returns what it measured."""
    import torch
    import torch.distributed.checkpoint as dcp

    from harness.checkpoint.hf_weights import export_hf, load_hf_weights, write_hf_meta

    start = time.perf_counter()
    if name == "save":  # the DCP checkpoint the converter reads
        model = build(layers, experts)
        model.init_weights(0)
        step = work / "checkpoint" / "step-1"
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(step), no_dist=True)
        (step / "hf").mkdir(exist_ok=True)
        write_hf_meta(step / "hf", model.args, "bfloat16", None)
        params = sum(p.numel() for p in model.parameters())
        return {"params": params, "seconds": time.perf_counter() - start}
    if name == "export":
        model = build(layers, experts)
        model.init_weights(0)
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        reset_peak_rss()
        start = time.perf_counter()
        export_hf(model, model.args, str(work / "hf"), torch.bfloat16, max_shard_bytes=int(shard_gib * GIB))
    elif name == "convert":
        from harness.convert import convert

        held = 0
        reset_peak_rss()
        convert(work / "checkpoint" / "step-1", work / "converted", "bfloat16", shard_gib)
    elif name == "import":
        model = build(layers, experts)
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        for p in model.parameters():  # touch the empty parameters: their pages count as held, not as the load's
            p.data.zero_()
        reset_peak_rss()
        start = time.perf_counter()
        load_hf_weights(model, model.args, str(work / "hf"))
    return {"peak": peak_rss(), "held": held, "seconds": time.perf_counter() - start}


def in_fresh_process(*argv: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--max-shard-gib", type=float, default=1.0)
    parser.add_argument("--workdir", default="/tmp/hf_io_memory")
    parser.add_argument("--stage", default=None)  # internal: run one stage in this process
    a = parser.parse_args()
    work = Path(a.workdir)
    if a.stage:
        print(json.dumps(stage(a.stage, work, a.layers, a.experts, a.max_shard_gib)))
        return
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    common = ["--layers", str(a.layers), "--experts", str(a.experts), "--max-shard-gib", str(a.max_shard_gib),
              "--workdir", str(work)]
    saved = in_fresh_process("--stage", "save", *common)
    bf16 = saved["params"] * 2 / GIB
    print(f"model: {saved['params'] / 1e9:.2f}B parameters ({bf16:.2f} GiB in bf16, {2 * bf16:.2f} GiB in fp32); "
          f"output shards of at most {a.max_shard_gib:g} GiB")
    results = {name: in_fresh_process("--stage", name, *common) for name in ("export", "convert", "import")}
    print(f"{'stage':8s} {'peak RSS':>10s} {'model held':>11s} {'beyond it':>10s} {'/ bf16 model':>13s} {'time':>7s}")
    for name, r in results.items():
        extra = (r["peak"] - r["held"]) / GIB
        print(f"{name:8s} {r['peak'] / GIB:9.2f}G {r['held'] / GIB:10.2f}G {extra:9.2f}G {extra / bf16:12.2f}x "
              f"{r['seconds']:6.1f}s")


if __name__ == "__main__":
    main()
