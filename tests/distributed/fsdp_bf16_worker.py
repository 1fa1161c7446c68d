"""Worker for test_fsdp_bf16 (a run of the shared launches, tests/distributed/launch.py): FSDP2 with bf16 params on
2 gloo ranks (forced on CPU, where the trainer would use fp32), one forward / backward / AdamW step of the debug
model at positions near 32k and 256k. Records what the fp32 contract promises and the rotary embedding's inputs and
outputs; rank 0 saves them to <folder>/result.pt."""

import os
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import models.qwen35_moe.attention as attention
from models.qwen35_moe import Qwen35MoeModel, get_flavor
from models.qwen35_moe.fp32_contract import Fp32ParamsModule
from parallel.parallelize import parallelize_qwen35_moe

POSITION_STARTS = (32_000, 262_000)  # one row each


def step(folder: str) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    args = get_flavor("debugmodel")
    with torch.device("meta"):
        model = Qwen35MoeModel(args)
    parallelize_qwen35_moe(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, ac_mode="none",
                           compile=False)
    model.to_empty(device="cpu")
    model.init_weights(0)

    record = {"forward": {}, "grads": {}, "rope": []}

    def note(key, p):
        record["forward"][key] = p.dtype
        if p.requires_grad:
            p.register_hook(lambda g: record["grads"].__setitem__(key, g.dtype))

    def watch(name, module):
        """In forward (after FSDP's all-gather): dtypes of the module's unsharded params, and of their grads."""
        def hook(mod, inputs):  # returns None: a pre-hook's return value would replace the inputs
            for pname, p in mod.named_parameters(recurse=False):
                note(f"{name}.{pname}", p)
        module.register_forward_pre_hook(hook)

    layer0 = model.layers["0"].linear_attn
    for name, module in model.named_modules():
        if isinstance(module, Fp32ParamsModule):
            watch(name, module)
    def bf16_neighbour(mod, inputs):  # for contrast (the layer uses its projections' weights directly)
        note("layers.0.linear_attn.in_proj_qkv.weight", mod.in_proj_qkv.weight)
    layer0.register_forward_pre_hook(bf16_neighbour)

    def spy_rope(x, cos, sin):
        out = apply_rope(x, cos, sin)
        record["rope"].append({"x": x.detach(), "cos_dtype": cos.dtype, "sin_dtype": sin.dtype, "out": out.detach()})
        return out

    apply_rope = attention.apply_rope

    gen = torch.Generator().manual_seed(0)
    seq = 64
    ids = torch.randint(0, args.vocab_size, (2, seq), generator=gen)
    positions = torch.stack([start + torch.arange(seq) for start in POSITION_STARTS])
    with mock.patch.object(attention, "apply_rope", spy_rope):
        out = model(ids, positions)
    out.logits.float().square().mean().backward()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.step()
    record["optimizer"] = {name: {k: v.dtype for k, v in optimizer.state[p].items() if torch.is_tensor(v) and v.ndim}
                           for name, p in model.named_parameters() if name.startswith("layers.0.linear_attn.")}
    record["positions"] = positions
    if dist.get_rank() == 0:
        torch.save(record, os.path.join(folder, "result.pt"))
