"""A LoRA run's FP8 base held in float8 under FSDP (models/qwen35_moe/fp8_hold.py): each held weight a float8 DTensor
of which each of 2 ranks keeps half, and the run the same as the same run with the base dequantized at the load, bit
for bit (losses, grad norms, merged export and PEFT adapter): FSDP's gather casts the float8 values to the policy's
dtype exactly, and each module dequantizes them with the scales every rank holds whole."""

import json

import torch

from tests.distributed.launch import Run, register
from tests.distributed.test_lora_export import tensors

WORKER = "tests.distributed.fp8_hold_worker:train"
RUNS = {hold: register(Run(f"fp8_hold_fsdp/{hold}", 2, WORKER, (hold,))) for hold in ("held", "dequantized")}


def _metrics(folder) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in (folder / "dump" / "metrics.jsonl").read_text().splitlines()]
    return [(r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


def test_the_fp8_base_is_held_sharded_in_float8_under_fsdp_and_trains_as_the_dequantized_base(launches):
    held, dequantized = (launches.folder_of(RUNS[hold]) for hold in ("held", "dequantized"))
    shards = torch.load(held / "result.pt")["held"]
    assert len(shards) > 10 and not torch.load(dequantized / "result.pt")["held"]  # the debug model has 17
    for name, (dtype, whole, local) in shards.items():
        assert dtype == "torch.float8_e4m3fn" and local[0] * 2 == whole[0] and local[1:] == whole[1:], name
    assert len(_metrics(held)) == 3 and _metrics(held) == _metrics(dequantized)
    for export in ("hf", "hf-adapter"):
        ours, theirs = tensors(held / "dump" / export), tensors(dequantized / "dump" / export)
        assert ours and ours.keys() == theirs.keys(), export
        for key, value in theirs.items():
            assert torch.equal(ours[key], value), f"{export}: {key}"
