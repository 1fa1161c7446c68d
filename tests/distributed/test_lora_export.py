"""LoRA's end-of-run exports from sharded layouts (FSDP over 2 ranks, EP=2 with its experts' adapters split, EP=2
with them also FSDP-sharded over 4) against one process: the merged weights gathered and summed per tensor give
the same files' tensors, bit for bit, and the PEFT adapter the same adapter tensors; so does the merged model
re-quantized into the FP8 release's layout, its shards written by the ranks in turn."""

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.launch import Run, register

WORKER = "tests.distributed.lora_export_worker:export"
EP = "--parallelism.expert_parallel_degree"
SINGLE = register(Run("lora_export/single", 1, WORKER))
LAYOUTS = {"fsdp2": (2, ()), "ep2": (2, (EP, "2")), "ep2_fsdp2": (4, (EP, "2"))}
RUNS = {name: register(Run(f"lora_export/{name}", nproc, WORKER, layout)) for name, (nproc, layout) in LAYOUTS.items()}


def tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out |= load_file(str(path))
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_lora_exports_equal_one_processes(launches, name):
    ref, got = launches.folder_of(SINGLE) / "dump", launches.folder_of(RUNS[name]) / "dump"
    for export in ("hf", "hf-adapter", "hf-fp8"):
        want, have = tensors(ref / export), tensors(got / export)
        assert want and have.keys() == want.keys(), export
        for key, value in want.items():
            assert torch.equal(have[key], value), f"{export}: {key}"
    merged = tensors(ref / "hf")
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in merged)
    fp8 = tensors(ref / "hf-fp8")
    assert any(v.dtype == torch.float8_e4m3fn for v in fp8.values()) and len(list((ref / "hf-fp8").glob("*"))) > 4
