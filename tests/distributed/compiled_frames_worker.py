"""Worker for test_compiled_frames (a run of the shared launches, tests/distributed/launch.py): the debug model
compiled (fp32, no AC), under FSDP over the gloo ranks and in one process, counting the compiled frames (dynamo's
"Torch-Compiled Region" events) each block's forward runs. The experts run as one traceable computation (as the
GPU's grouped GEMMs are), so a block's only breaks are its own (the Gated DeltaNet's kernel call, and a marker hook
that opens each block's count); under FSDP the first block's routed experts are a unit of their own, whose hooks
break its MoE. Rank 0 saves both runs' counts per block to <folder>/result.pt."""

import os
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile, record_function

from models.qwen35_moe import Qwen35MoeModel, moe
from parallel.parallelize import parallelize_qwen35_moe
from tests.builders import debugmodel_4_layers, experts_in_one_graph
from tests.compiled import batch_ids, compiled_without_inductor


def frames_per_block(mesh, ids: torch.Tensor) -> list[int]:
    torch._dynamo.reset()
    with torch.device("meta"):
        model = Qwen35MoeModel(debugmodel_4_layers())
    for index, layer in enumerate(model.layers.values()):
        @torch._dynamo.disable
        def mark(module, args, index=index):  # an instant event where each block's forward starts
            with record_function(f"block {index}"):
                pass

        layer.register_forward_pre_hook(mark)
    parallelize_qwen35_moe(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, ac_mode="none",
                           compile=True)
    model.to_empty(device="cpu")
    model.init_weights(0)
    model(ids)  # compiles: frames are dynamo's, decided in the forward
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(ids)
    events = sorted((e for e in prof.events() if e.name.startswith(("block ", "Torch-Compiled Region"))),
                    key=lambda e: e.time_range.start)
    counts = []
    for event in events:
        if event.name.startswith("block "):
            counts.append(0)
        elif counts:
            counts[-1] += 1
    return counts


def count(folder: str) -> None:
    ids = batch_ids(0)
    # The frames and their breaks are dynamo's, decided before a backend compiles the graphs between them: the plain
    # eager backend runs them, without AOT autograd's joint graphs.
    with mock.patch.object(moe.RoutedExperts, "forward", experts_in_one_graph), compiled_without_inductor("eager"):
        fsdp = frames_per_block(init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",)), ids)
        if dist.get_rank() == 0:  # the one-process model, compiled once
            torch.save({"fsdp": fsdp, "one_process": frames_per_block(None, ids)}, os.path.join(folder, "result.pt"))
