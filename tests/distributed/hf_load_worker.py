"""Worker for test_hf_load (a run of the shared launches, tests/distributed/launch.py): rank 0 writes the debug
model's weights (`source_model`) as an HF checkpoint of the given layout to <folder>/hf; then every rank builds the
model through the trainer with checkpoint.initial_load_hf (rank 0 reads, every rank keeps its shard), and rank 0
saves to <folder>/result.pt the full weights, and how far apart the ranks' copies of the parameters FSDP leaves whole
are. The arguments after the layout are config overrides."""

import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from models.qwen35_moe import Qwen35MoeStateDictAdapter, get_flavor, save_hf_checkpoint
from tests.builders import initialized_model
from tests.distributed.fsdp_step_worker import full, replica_spread
from tests.distributed.trainer_runs import close_keeping_process_group, debug_trainer


def source_model():
    """The weights every checkpoint holds."""
    return initialized_model(get_flavor("debugmodel"), seed=7)


def multimodal_per_expert(hf: dict) -> dict:
    """The released checkpoints' layout: language model under model.language_model., experts one by one,
    plus vision and MTP tensors the text model ignores."""
    out = {"model.visual.patch_embed.weight": torch.zeros(4, 4), "mtp.fc.weight": torch.zeros(4, 4)}
    for key, value in hf.items():
        key = key.replace("model.", "model.language_model.", 1) if key.startswith("model.") else key
        if key.endswith("experts.gate_up_proj"):
            base = key.removesuffix(".gate_up_proj")
            for e, w in enumerate(value):
                gate, up = w.chunk(2, dim=0)
                out[f"{base}.{e}.gate_proj.weight"], out[f"{base}.{e}.up_proj.weight"] = gate.clone(), up.clone()
        elif key.endswith("experts.down_proj"):
            base = key.removesuffix(".down_proj")
            for e, w in enumerate(value):
                out[f"{base}.{e}.down_proj.weight"] = w.clone()
        else:
            out[key] = value
    return out


def write_checkpoint(folder: Path, layout: str) -> None:
    """"text_fused": save_hf_checkpoint's own, in shards; "multimodal_per_expert": its config and tokenizer files
    with the tensors in the released checkpoints' layout instead."""
    source = source_model()
    save_hf_checkpoint(source.state_dict(), source.args, folder, dtype=torch.float32, max_shard_bytes=200_000)
    if layout == "multimodal_per_expert":
        hf = Qwen35MoeStateDictAdapter(source.args).to_hf(source.state_dict())
        for f in folder.glob("*.safetensors*"):
            f.unlink()
        save_file(multimodal_per_expert(hf), str(folder / "model.safetensors"))


def load(folder: str, layout: str, *overrides: str) -> None:
    if dist.get_rank() == 0:
        write_checkpoint(Path(folder, "hf"), layout)
    dist.barrier()
    trainer = debug_trainer(folder, "--checkpoint.initial_load_hf", os.path.join(folder, "hf"), *overrides)
    weights = {name: full(p) for name, p in trainer.model.state_dict().items()}
    spread = replica_spread(trainer.model)
    if trainer.rank == 0:
        torch.save({"weights": weights, "replica_spread": spread}, os.path.join(folder, "result.pt"))
    close_keeping_process_group(trainer)
