"""`fsdp_reshard_after_forward = "auto"` through the trainer on CPU ranks, its GPU path driven by a host analog of
the GPU's memory (tests/distributed/reshard_auto_worker.py): after step 1 it gathers every resharding unit once
(blocks, the first block's experts, EP's expert units on their mesh) and measures what the plain model says those
units hold; with room it keeps them and the run's losses are the default run's to the last bit (float64); with no
room nothing changes."""

import json

import pytest
import torch

from models.qwen35_moe import get_flavor
from models.qwen35_moe.fp32_contract import Fp32ParamsModule
from models.qwen35_moe.moe import RoutedExperts
from tests.builders import initialized_model
from tests.distributed.launch import Run, register

WORKER = "tests.distributed.reshard_auto_worker:run"
ROOM, NO_ROOM = str(10**15), "0"


def gathered_bytes_expected(ep: int) -> int:
    """What the resharding units gather, from the plain model (float64): every block but the last, less the GDN
    layers' fp32 parameters (FSDP leaves them whole); under EP only this rank's experts."""
    torch.set_default_dtype(torch.float64)
    try:
        layers = list(initialized_model(get_flavor("debugmodel")).layers.values())
    finally:
        torch.set_default_dtype(torch.float32)
    total = 0
    for layer in layers[:-1]:
        whole = {id(p) for m in layer.modules() if isinstance(m, Fp32ParamsModule) for p in m.parameters()}
        experts = {id(p) for m in layer.modules() if isinstance(m, RoutedExperts) for p in m.parameters()}
        total += sum(p.numel() * 8 // (ep if id(p) in experts else 1) for p in layer.parameters() if id(p) not in whole)
    return total


EP2 = ("--parallelism.expert_parallel_degree", "2")
RUNS = {  # layout: runs (mode and memory) of it
    "fsdp2": {name: register(Run(f"reshard_auto/fsdp2_{name}", 2, WORKER, (mode, capacity)))
              for name, mode, capacity in [("default", "always", ROOM), ("auto", "auto", ROOM),
                                           ("tight", "auto", NO_ROOM)]},
    "ep2_fsdp2": {name: register(Run(f"reshard_auto/ep2_fsdp2_{name}", 4, WORKER, (mode, ROOM, *EP2)))
                  for name, mode in [("default", "always"), ("auto", "auto")]},
}


@pytest.mark.parametrize("name, ep", [("fsdp2", 1), ("ep2_fsdp2", 2)])
def test_auto_measures_the_units_and_keeps_their_weights_without_changing_the_run(launches, name, ep):
    results = {run: json.loads((launches.folder_of(r) / "result.json").read_text()) for run, r in RUNS[name].items()}
    default, auto = results["default"], results["auto"]
    assert default["measured"] == [] and default["left"] == default["units"] > 0
    assert auto["measured"] == [gathered_bytes_expected(ep)] and auto["left"] == 0
    assert auto["losses"] == default["losses"] and len(auto["losses"]) == 3
    if ep == 1:
        tight = results["tight"]
        assert tight["measured"] == auto["measured"] and tight["left"] == tight["units"]
        assert tight["losses"] == default["losses"]
