"""The export's tensors against the release's layout (names, dtypes, shapes), the MTP layer's experts per expert as
the release stores them, and the two writers of an export (end of run, offline converter) on them: the same bytes,
each native tensor read once."""

from __future__ import annotations

import json
import struct
import weakref
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from harness.checkpoint.hf_weights import ExportTensors, export_hf, load_hf_weights, write_hf_folder
from harness.convert import main as convert_main
from models.qwen35_moe import Qwen35MoeArgs, Qwen35MoeModel, Qwen35MoeStateDictAdapter, from_pretrained, get_flavor
from tests.builders import initialized_model
from tests.unit.test_convert_output_folder import saved_step

ARGS = get_flavor("debugmodel_mtp")
SMALL_SHARDS_GIB = 2**-14  # 64 KiB: the debug model's export in several shards, the MTP experts across two


def release_layout(a: Qwen35MoeArgs) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{key: (dtype, shape)} of the text and MTP tensors of a Qwen3.5-MoE release (Qwen/Qwen3.5-35B-A3B's
    model.safetensors.index.json and shard headers), at the shapes of `a`. The text model lies under
    `model.language_model.` (the vision tower, `model.visual.*`, is left out here), `lm_head` and `mtp.*` at the top
    level. The main layers' routed experts are fused, `mlp.experts.gate_up_proj` (E, 2I, H) and `down_proj`
    (E, H, I); the MTP layer's are per expert, `mtp.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight` (768 of
    the 35B's 785 `mtp.*` tensors). Everything is BF16 but `linear_attn.A_log` and `linear_attn.norm.weight` (F32;
    `dt_bias` is BF16)."""
    h, e, i, shared = a.hidden_size, a.num_experts, a.moe_intermediate_size, a.shared_expert_intermediate_size
    qkv = 2 * a.linear_num_key_heads * a.linear_key_head_dim + a.linear_num_value_heads * a.linear_value_head_dim
    values, heads, hd = a.linear_num_value_heads * a.linear_value_head_dim, a.num_attention_heads, a.head_dim
    bf16 = "BF16"

    def block(prefix: str, kind: str, per_expert: bool) -> dict:
        out = {f"{prefix}input_layernorm.weight": (bf16, (h,)),
               f"{prefix}post_attention_layernorm.weight": (bf16, (h,)),
               f"{prefix}mlp.gate.weight": (bf16, (e, h)), f"{prefix}mlp.shared_expert_gate.weight": (bf16, (1, h)),
               f"{prefix}mlp.shared_expert.gate_proj.weight": (bf16, (shared, h)),
               f"{prefix}mlp.shared_expert.up_proj.weight": (bf16, (shared, h)),
               f"{prefix}mlp.shared_expert.down_proj.weight": (bf16, (h, shared))}
        if per_expert:
            for x in range(e):
                out[f"{prefix}mlp.experts.{x}.gate_proj.weight"] = (bf16, (i, h))
                out[f"{prefix}mlp.experts.{x}.up_proj.weight"] = (bf16, (i, h))
                out[f"{prefix}mlp.experts.{x}.down_proj.weight"] = (bf16, (h, i))
        else:
            out[f"{prefix}mlp.experts.gate_up_proj"] = (bf16, (e, 2 * i, h))
            out[f"{prefix}mlp.experts.down_proj"] = (bf16, (e, h, i))
        if kind == "linear_attention":
            la = prefix + "linear_attn."
            out |= {la + "in_proj_qkv.weight": (bf16, (qkv, h)), la + "in_proj_z.weight": (bf16, (values, h)),
                    la + "in_proj_a.weight": (bf16, (a.linear_num_value_heads, h)),
                    la + "in_proj_b.weight": (bf16, (a.linear_num_value_heads, h)),
                    la + "conv1d.weight": (bf16, (qkv, 1, a.linear_conv_kernel_dim)),
                    la + "A_log": ("F32", (a.linear_num_value_heads,)),
                    la + "dt_bias": (bf16, (a.linear_num_value_heads,)),
                    la + "norm.weight": ("F32", (a.linear_value_head_dim,)),
                    la + "out_proj.weight": (bf16, (h, values))}
        else:
            sa = prefix + "self_attn."
            out |= {sa + "q_proj.weight": (bf16, (2 * heads * hd, h)),
                    sa + "k_proj.weight": (bf16, (a.num_key_value_heads * hd, h)),
                    sa + "v_proj.weight": (bf16, (a.num_key_value_heads * hd, h)),
                    sa + "o_proj.weight": (bf16, (h, heads * hd)), sa + "q_norm.weight": (bf16, (hd,)),
                    sa + "k_norm.weight": (bf16, (hd,))}
        return out

    text = "model.language_model."
    layout = {text + "embed_tokens.weight": (bf16, (a.vocab_size, h)), text + "norm.weight": (bf16, (h,)),
              "lm_head.weight": (bf16, (a.vocab_size, h)), "mtp.fc.weight": (bf16, (h, 2 * h)),
              "mtp.norm.weight": (bf16, (h,)), "mtp.pre_fc_norm_embedding.weight": (bf16, (h,)),
              "mtp.pre_fc_norm_hidden.weight": (bf16, (h,))}
    for n, kind in enumerate(a.layer_types):
        layout |= block(f"{text}layers.{n}.", kind, per_expert=False)
    for n in range(a.mtp_num_hidden_layers):
        layout |= block(f"mtp.layers.{n}.", "full_attention", per_expert=True)
    return layout


def headers(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{key: (dtype, shape)} from the safetensors headers of an HF folder."""
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        out |= {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}
    return out


def _perturbed(args=ARGS, seed=0):
    """Weights away from their init (norms at 0, equal experts): every tensor distinct."""
    model = initialized_model(args, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def test_export_has_the_release_layout_but_the_text_prefix_and_dt_bias_in_f32(tmp_path):
    """Key for key against the release: the export is the text-only CausalLM (`model.` where the release's multimodal
    model has `model.language_model.`), and writes dt_bias F32 (trained in fp32; the release's BF16 values upcast
    exactly); every other name, dtype and shape is the release's, the MTP experts per expert."""
    export_hf(initialized_model(ARGS), ARGS, str(tmp_path / "hf"), torch.bfloat16)
    ours = {k.replace("model.", "model.language_model.", 1): v for k, v in headers(tmp_path / "hf").items()}
    release = release_layout(ARGS)
    assert ours.keys() == release.keys(), (sorted(ours.keys() - release.keys()), sorted(release.keys() - ours.keys()))
    differ = {k for k in release if ours[k] != release[k]}
    assert differ == {k for k in release if k.endswith("linear_attn.dt_bias")}
    assert all(ours[k] == ("F32", release[k][1]) for k in differ)


def test_converter_writes_the_end_of_run_export_byte_for_byte_with_mtp_experts_across_shards(tmp_path):
    """The same model through both writers, in 64 KiB shards: identical files, several shards, the MTP experts split
    over more than one; our import loads it back exactly."""
    model = _perturbed()
    export_hf(model, ARGS, str(tmp_path / "hf"), torch.float32, max_shard_bytes=int(SMALL_SHARDS_GIB * 1024**3))
    saved_step(tmp_path / "run" / "checkpoint" / "step-20", model, ARGS, export_dtype="float32")
    assert convert_main([str(tmp_path / "run" / "checkpoint" / "step-20"), str(tmp_path / "converted"),
                         "--max-shard-gib", str(SMALL_SHARDS_GIB)]) == 0
    exported = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert sorted(p.name for p in (tmp_path / "converted").iterdir()) == exported
    for name in exported:
        assert (tmp_path / "converted" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    weight_map = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert len({f for k, f in weight_map.items() if k.startswith("mtp.layers.0.mlp.experts.")}) > 1

    back = Qwen35MoeModel(ARGS)
    load_hf_weights(back, ARGS, str(tmp_path / "converted"))
    loaded = from_pretrained(tmp_path / "converted").state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[key], value) and torch.equal(loaded[key], value), key


def test_each_native_tensor_is_gathered_and_read_once(tmp_path, one_rank_mesh, monkeypatch):
    """A fused MTP expert tensor feeds 3E of the export's keys; the end-of-run export gathers it (full_tensor, a
    collective under FSDP) once, the converter reads it from the checkpoint once, and the files are those of the
    plain model's export."""
    model = _perturbed()
    sharded = {k: distribute_tensor(v.detach(), one_rank_mesh, [Shard(0)]) for k, v in model.state_dict().items()}
    gathered, read = [], []
    full_tensor = DTensor.full_tensor
    monkeypatch.setattr(DTensor, "full_tensor", lambda self: gathered.append(self) or full_tensor(self))
    shards = int(SMALL_SHARDS_GIB * 1024**3)
    export_hf(SimpleNamespace(state_dict=lambda: sharded, named_modules=list), ARGS, str(tmp_path / "sharded"), torch.bfloat16,
              max_shard_bytes=shards)
    assert len(gathered) == len(sharded) and len(set(map(id, gathered))) == len(sharded)
    export_hf(model, ARGS, str(tmp_path / "plain"), torch.bfloat16, max_shard_bytes=shards)
    for path in (tmp_path / "plain").iterdir():
        assert (tmp_path / "sharded" / path.name).read_bytes() == path.read_bytes(), path.name

    saved_step(tmp_path / "step-20", model, ARGS)
    load = dcp.load
    monkeypatch.setattr(dcp, "load", lambda state, **kw: read.extend(state) or load(state, **kw))
    assert convert_main([str(tmp_path / "step-20"), str(tmp_path / "converted")]) == 0
    assert sorted(read) == sorted(f"model.{k}" for k in model.state_dict())


def test_at_most_an_mtp_layers_two_expert_tensors_are_held_at_once(tmp_path):
    """The memory bound of ExportTensors: when a native tensor is read, the only other one still alive is its partner
    (an MTP layer's gate_up_proj and down_proj, whose per-expert keys interleave), also when the HF tensors written
    are views of it (float32 export of a float32 model)."""
    state = _perturbed().state_dict()
    alive, at_read = set(), []

    def read(key: str) -> torch.Tensor:
        at_read.append(set(alive))
        tensor = state[key].clone()  # a tensor of its own, whose release can be seen
        alive.add(key)
        weakref.finalize(tensor, alive.discard, key)
        return tensor

    tensors = ExportTensors(Qwen35MoeStateDictAdapter(ARGS), {k: tuple(v.shape) for k, v in state.items()},
                            torch.float32, read)
    write_hf_folder(tmp_path / "hf", ARGS, torch.float32, tensors.specs, tensors.fetch,
                    max_shard_bytes=int(SMALL_SHARDS_GIB * 1024**3))
    assert len(at_read) == len(state) and not alive
    partners = {"mtp.layers.0.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts.down_proj"}
    assert all(not others or (len(others) == 1 and others <= partners) for others in at_read)
    assert any(others for others in at_read)  # the pair was held together
