"""checkpoint.initial_load_hf on 2 gloo ranks: rank 0 reads the HF checkpoint one tensor at a time (per-expert
weights fused one tensor at a time) and scatters it; every rank ends with exactly the checkpoint's weights, for
the text-only fused layout and the multimodal per-expert one, also into experts split over the ranks (EP=2)."""

import pytest
import torch
from safetensors.torch import save_file

from models.qwen35_moe import Qwen35MoeStateDictAdapter, get_flavor, save_hf_checkpoint
from tests.builders import initialized_model
from tests.distributed.launch import REPO, run, torchrun

WORKER = str(REPO / "tests" / "distributed" / "hf_load_worker.py")


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


@pytest.mark.parametrize("layout, overrides", [
    ("text_fused", []), ("multimodal_per_expert", []),
    ("multimodal_per_expert", ["--parallelism.expert_parallel_degree", "2"]),
])
def test_two_ranks_load_exactly_the_checkpoints_weights(tmp_path, layout, overrides):
    source = initialized_model(get_flavor("debugmodel"), seed=7)
    folder = tmp_path / "hf"
    save_hf_checkpoint(source.state_dict(), source.args, folder, dtype=torch.float32, max_shard_bytes=200_000)
    if layout == "multimodal_per_expert":
        hf = Qwen35MoeStateDictAdapter(source.args).to_hf(source.state_dict())
        for f in folder.glob("*.safetensors*"):
            f.unlink()
        save_file(multimodal_per_expert(hf), str(folder / "model.safetensors"))

    run([*torchrun(2), WORKER, str(tmp_path / "w.pt"), str(folder), *overrides], tmp_path)
    saved, want = torch.load(tmp_path / "w.pt"), source.state_dict()
    loaded = saved["weights"]
    assert loaded.keys() == want.keys()
    assert saved["replica_spread"] == 0.0  # the parameters whole on every rank, the same on each (rank 1 too)
    for key, value in want.items():
        assert torch.equal(loaded[key], value), key
