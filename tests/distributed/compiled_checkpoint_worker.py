"""Worker for test_compiled_checkpointing: the debug model under FSDP over the gloo ranks, in fp32, once eager
without activation checkpointing and once compiled with full AC (two halves per block,
parallel/activation_checkpointing.py), from the same weights on the same tokens. The experts run as one traceable
computation (as the GPU's grouped GEMMs are), so the MoE halves have no graph break of their own; the first
block's routed experts are an FSDP unit, whose hooks break its MoE half. Rank 0 saves both runs' losses and
gradients, and which blocks' MoE halves dynamo traced with their checkpoint."""

import gc
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from models.qwen35_moe import Qwen35MoeModel, get_flavor, moe
from parallel.parallelize import parallelize_qwen35_moe
from tests.builders import experts_in_one_graph
from tests.distributed.fsdp_step_worker import full


def step(mesh, ids: torch.Tensor, ac_mode: str, compile: bool) -> dict:
    with torch.device("meta"):
        model = Qwen35MoeModel(get_flavor("debugmodel"))
    parallelize_qwen35_moe(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, ac_mode=ac_mode,
                           compile=compile)
    model.to_empty(device="cpu")
    model.init_weights(0)
    for _ in range(2):  # compiled: the second step runs what the first compiled
        model.zero_grad()
        out = model(ids)
        loss = F.cross_entropy(out.logits.flatten(0, 1), ids.roll(-1, dims=1).flatten()) + 0.01 * out.aux_loss
        loss.backward()
    return {"loss": loss.detach(), "grads": {n: full(p.grad) for n, p in model.named_parameters()},
            "traced": [getattr(layer.runner, "moe_half_traced", None) for layer in model.layers.values()]}


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    moe.RoutedExperts.forward = experts_in_one_graph
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(dist.get_rank()))
    record = {"eager": step(mesh, ids, "none", compile=False), "full": step(mesh, ids, "full", compile=True)}
    if dist.get_rank() == 0:
        torch.save(record, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    gc.collect()  # the process groups freed before the interpreter finalizes (harness/train.py)
