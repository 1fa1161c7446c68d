"""Compiled blocks under FSDP run the frames one process runs, except the first block (compiled_frames_worker.py).

The first block's routed experts are an FSDP unit of their own, whose hooks break its compiled MoE. Dynamo keeps
compiled frames per code object and skips guards on FSDP-managed modules, so the other blocks reused the first
block's frames, break included: two more compiled frames per block (the MoE, and the residual add after it), as a
profiled FSDP=2 step on GPUs showed (60 compiled-function calls in the forward against one GPU's 40 at 8 layers).
parallel/compile.py gives the first block a copy of run_block's code; without it this test counts 11 frames where one
process runs 9."""

import torch

from tests.distributed.launch import Run, register

COUNT = register(Run("compiled_frames/count", 2, "tests.distributed.compiled_frames_worker:count"))


def test_blocks_after_the_first_run_one_process_compiled_frames_under_fsdp(launches):
    record = torch.load(launches.folder_of(COUNT) / "result.pt")
    fsdp, one_process = record["fsdp"], record["one_process"]
    assert len(fsdp) == len(one_process) > 2
    assert fsdp[1:] == one_process[1:], (fsdp, one_process)
    assert fsdp[0] > one_process[0]  # the first block's experts' hooks do break its MoE
