"""The HF checkpoint layouts and dtypes are an API: round trips, fp32 routing and clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from models.qwen35_moe import (
    Qwen35MoeArgs,
    Qwen35MoeModel,
    Qwen35MoeStateDictAdapter,
    from_pretrained,
    load_hf_state_dict,
    save_hf_checkpoint,
)
from models.qwen35_moe.hf_checkpoint import EXPORT_MARKER
from models.qwen35_moe.state_dict_adapter import hf_export_dtype
from tests.builders import initialized_model
from tests.hf_reference import TINY_HF_CONFIG, official_dtypes, per_expert

ARGS = Qwen35MoeArgs.from_hf_config(TINY_HF_CONFIG)


def _native_model(seed=0) -> Qwen35MoeModel:
    return initialized_model(ARGS, seed)


def test_native_state_dict_holds_fp32_gate_in_holder():
    sd = _native_model().state_dict()
    assert "layers.0.linear_attn._fp32_params.A_log" in sd
    assert "layers.0.linear_attn._fp32_params.dt_bias" in sd
    assert not any(k.endswith("linear_attn.A_log") for k in sd)


def test_hf_export_has_no_holder_andofficial_dtypes():
    hf = Qwen35MoeStateDictAdapter(ARGS).to_hf(_native_model().state_dict())
    assert not any("_fp32_params" in k for k in hf)
    assert "model.layers.0.linear_attn.A_log" in hf and "lm_head.weight" in hf
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf
    assert hf_export_dtype("model.layers.0.linear_attn.A_log", torch.bfloat16) == torch.float32
    assert hf_export_dtype("model.layers.0.linear_attn.dt_bias", torch.bfloat16) == torch.float32
    assert hf_export_dtype("model.layers.0.linear_attn.norm.weight", torch.bfloat16) == torch.float32
    assert hf_export_dtype("model.layers.0.linear_attn.out_proj.weight", torch.bfloat16) == torch.bfloat16
    assert hf_export_dtype("model.layers.3.self_attn.q_norm.weight", torch.bfloat16) == torch.bfloat16


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_hf_native_hf_round_trip_is_bit_exact(layout):
    adapter = Qwen35MoeStateDictAdapter(ARGS)
    fused = official_dtypes(adapter.to_hf(_native_model().state_dict()))
    source = fused if layout == "fused" else per_expert(fused)
    back = adapter.to_hf(adapter.from_hf(source))
    assert back.keys() == fused.keys()
    for k, v in fused.items():
        assert back[k].dtype == v.dtype, k
        assert torch.equal(back[k], v), k


def test_bf16_checkpoint_loads_with_fp32_gate(tmp_path):
    adapter = Qwen35MoeStateDictAdapter(ARGS)
    hf = {k: v.to(torch.bfloat16) for k, v in adapter.to_hf(_native_model().state_dict()).items()}
    native = adapter.from_hf(hf)
    assert native["layers.0.linear_attn._fp32_params.A_log"].dtype == torch.float32
    assert native["layers.0.linear_attn._fp32_params.dt_bias"].dtype == torch.float32

    save_hf_checkpoint(_native_model().state_dict(), ARGS, tmp_path / "ckpt", dtype=torch.bfloat16)
    model = from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    layer = model.layers["0"].linear_attn
    assert layer.in_proj_qkv.weight.dtype == torch.bfloat16
    assert layer.A_log.dtype == torch.float32 and layer.dt_bias.dtype == torch.float32


def test_exported_folder_has_official_dtypes_and_config(tmp_path):
    save_hf_checkpoint(_native_model().state_dict(), ARGS, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe_text"
    assert config["architectures"] == ["Qwen3_5MoeForCausalLM"]
    hf = load_hf_state_dict(tmp_path / "ckpt")
    assert hf["model.layers.0.linear_attn.A_log"].dtype == torch.float32
    assert hf["model.layers.0.linear_attn.norm.weight"].dtype == torch.float32
    assert hf["model.layers.0.linear_attn.in_proj_qkv.weight"].dtype == torch.bfloat16


def test_sharded_export_round_trips(tmp_path):
    sd = _native_model().state_dict()
    save_hf_checkpoint(sd, ARGS, tmp_path / "ckpt", dtype=torch.float32, max_shard_bytes=20_000)
    assert (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    loaded = from_pretrained(tmp_path / "ckpt").state_dict()
    for k, v in sd.items():
        assert torch.equal(loaded[k], v), k


def test_layer_exposes_read_only_fp32_gate_params():
    layer = _native_model().layers["0"].linear_attn
    assert layer.A_log is layer._fp32_params.A_log
    assert layer.dt_bias is layer._fp32_params.dt_bias
    assert "A_log" not in dict(layer.named_parameters(recurse=False))


@pytest.mark.parametrize("key, value, named", [  # value None: the key is deleted
    pytest.param("model.layers.2.mlp.experts.down_proj", None, r"missing keys: layers\.2\.mlp\.experts\.down_proj",
                 id="missing_key"),
    pytest.param("model.embed_tokens.weight", torch.zeros(7, 32),
                 r"wrong shapes: embed_tokens\.weight \(7, 32\) \(expected \(96, 32\)\)", id="wrong_shape"),
    pytest.param("model.layers.9.mlp.gate.weight", torch.zeros(8, 32), r"unexpected keys: layers\.9\.mlp\.gate\.weight",
                 id="unexpected_key"),
])
def test_a_missing_misshapen_or_unexpected_key_is_named(key, value, named):
    adapter = Qwen35MoeStateDictAdapter(ARGS)
    hf = adapter.to_hf(_native_model().state_dict())
    if value is None:
        del hf[key]
    else:
        hf[key] = value
    with pytest.raises(ValueError, match=named):
        adapter.from_hf(hf)


def test_incomplete_per_expert_checkpoint_is_named():
    adapter = Qwen35MoeStateDictAdapter(ARGS)
    hf = per_expert(adapter.to_hf(_native_model().state_dict()))
    del hf["model.layers.1.mlp.experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.5\.up_proj\.weight"):
        adapter.from_hf(hf)


def test_missing_or_corrupt_checkpoint_files_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_state_dict(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    with pytest.raises(ValueError, match="cannot read"):
        load_hf_state_dict(bad)


def test_failed_export_keeps_existing_folder(tmp_path):
    """Export writes to a temporary folder first: an error mid-way leaves the previous export intact."""
    sd = _native_model().state_dict()
    save_hf_checkpoint(sd, ARGS, tmp_path / "hf", dtype=torch.float32)
    before = load_hf_state_dict(tmp_path / "hf")
    broken = dict(sd)
    broken["layers.0.mlp.gate.weight"] = object()  # not a tensor: the export fails
    with pytest.raises(AttributeError):
        save_hf_checkpoint(broken, ARGS, tmp_path / "hf")
    after = load_hf_state_dict(tmp_path / "hf")
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_export_ignores_leftovers_of_an_interrupted_export(tmp_path):
    """A `<folder>.tmp` left by an export that died mid-way (stale shards and index) must not leak into the
    next export: the folder holds exactly the new files and loads the new weights."""
    stale = _native_model(seed=1).state_dict()
    save_hf_checkpoint(stale, ARGS, tmp_path / "hf.tmp", dtype=torch.float32, max_shard_bytes=20_000)
    assert (tmp_path / "hf.tmp" / "model.safetensors.index.json").is_file()  # the stale, sharded leftover

    fresh = _native_model(seed=2).state_dict()
    save_hf_checkpoint(fresh, ARGS, tmp_path / "hf", dtype=torch.float32)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors", EXPORT_MARKER]
    assert not (tmp_path / "hf.tmp").exists()
    loaded = from_pretrained(tmp_path / "hf").state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in fresh.items())


def test_gdn_output_norm_stays_fp32_and_round_trips_exactly_through_bf16_model(tmp_path):
    """linear_attn.norm.weight is F32 in the official checkpoint: a bf16 model keeps it fp32 in memory and
    re-exports the exact values (a bf16 round trip changed it by up to 3.5e-3 relative before)."""
    model = _native_model()
    with torch.no_grad():
        for layer in model.layers.values():
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.norm.weight.add_(torch.randn_like(layer.linear_attn.norm.weight) * 0.1)
    save_hf_checkpoint(model.state_dict(), ARGS, tmp_path / "a", dtype=torch.bfloat16)
    bf16 = from_pretrained(tmp_path / "a", dtype=torch.bfloat16)
    assert bf16.layers["0"].linear_attn.norm.weight.dtype == torch.float32
    assert bf16.layers["0"].linear_attn.in_proj_qkv.weight.dtype == torch.bfloat16
    save_hf_checkpoint(bf16.state_dict(), ARGS, tmp_path / "b", dtype=torch.bfloat16)
    a, b = load_hf_state_dict(tmp_path / "a"), load_hf_state_dict(tmp_path / "b")
    norms = [k for k in a if k.endswith("linear_attn.norm.weight")]
    assert norms and all(b[k].dtype == torch.float32 and torch.equal(a[k], b[k]) for k in norms)
    want = model.state_dict()
    assert all(torch.equal(b[k], want[k.removeprefix("model.")]) for k in norms)  # the trained fp32 values
