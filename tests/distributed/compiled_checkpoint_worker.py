"""Worker for test_compiled_checkpointing (a run of the shared launches, tests/distributed/launch.py): the debug
model under FSDP over the gloo ranks, in fp32, once eager without activation checkpointing and once compiled with
full AC (two halves per block, parallel/activation_checkpointing.py), from the same weights on the same tokens. The
experts run as one traceable computation (as the GPU's grouped GEMMs are), so the MoE halves have no graph break of
their own; the first block's routed experts are an FSDP unit, whose hooks break its MoE half. Rank 0 saves both
runs' losses and gradients, and which blocks' MoE halves dynamo traced with their checkpoint, to <folder>/result.pt."""

import os
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from models.qwen35_moe import Qwen35MoeModel, get_flavor, moe
from parallel.parallelize import parallelize_qwen35_moe
from tests.builders import experts_in_one_graph
from tests.compiled import batch_ids, compiled_without_inductor, training_loss
from tests.distributed.fsdp_step_worker import full


def step(mesh, ids: torch.Tensor, ac_mode: str, compile: bool) -> dict:
    with torch.device("meta"):
        model = Qwen35MoeModel(get_flavor("debugmodel"))
    parallelize_qwen35_moe(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, ac_mode=ac_mode,
                           compile=compile)
    model.to_empty(device="cpu")
    model.init_weights(0)
    for _ in range(2 if compile else 1):  # compiled: the second step runs what the first compiled (no update between)
        model.zero_grad()
        loss = training_loss(model(ids), ids)
        loss.backward()
    return {"loss": loss.detach(), "grads": {n: full(p.grad) for n, p in model.named_parameters()},
            "traced": [getattr(layer.runner, "moe_half_traced", None) for layer in model.layers.values()]}


def compare(folder: str) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    ids = batch_ids(dist.get_rank())
    # What FSDP changes is dynamo's and AOT's: the first block's MoE half broken by its experts' unit, the others'
    # checkpoints traced, weights gathered again for the recompute. Inductor's code for these blocks under full AC
    # (one process) is checked by tests/unit/test_compile.py (test_full_checkpointing_compiles_each_moe_half_...).
    with mock.patch.object(moe.RoutedExperts, "forward", experts_in_one_graph), compiled_without_inductor():
        record = {"eager": step(mesh, ids, "none", compile=False), "full": step(mesh, ids, "full", compile=True)}
    if dist.get_rank() == 0:
        torch.save(record, os.path.join(folder, "result.pt"))
