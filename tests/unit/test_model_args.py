"""Model args, flavors and config.json conversion."""

import copy

import pytest
import torch

from models.qwen35_moe import Qwen35MoeArgs, Qwen35MoeModel, get_flavor, qwen35_moe_flavors
from tests.builders import initialized_model
from tests.hf_reference import TINY_HF_CONFIG


def test_35b_flavor_has_the_released_shape():
    a = get_flavor("35B-A3B")
    assert (a.hidden_size, a.num_hidden_layers, a.vocab_size) == (2048, 40, 248320)
    assert (a.num_attention_heads, a.num_key_value_heads, a.head_dim) == (16, 2, 256)
    assert (a.linear_num_key_heads, a.linear_num_value_heads, a.linear_key_head_dim, a.linear_value_head_dim) == (16, 32, 128, 128)
    assert (a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size, a.shared_expert_intermediate_size) == (256, 8, 512, 512)
    assert a.linear_conv_kernel_dim == 4 and a.rotary_dim == 64
    assert a.layer_types[3] == "full_attention" and a.num_layers_of("full_attention") == 10


def test_debug_flavor_is_hybrid_with_enough_experts():
    a = get_flavor("debugmodel")
    assert a.layer_types == ["linear_attention", "full_attention"]
    assert a.num_experts >= 8


def test_flavor_registry_is_not_mutated_by_callers():
    a = get_flavor("debugmodel")
    a.layer_types[0] = "full_attention"
    assert qwen35_moe_flavors["debugmodel"].layer_types[0] == "linear_attention"


# The text model's fields of the released Qwen3.5-35B-A3B config.json (its `text_config`).
OFFICIAL_35B_A3B_TEXT_CONFIG = {
    "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "vocab_size": 248320,
    "hidden_size": 2048, "num_hidden_layers": 40, "full_attention_interval": 4, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
    "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": False, "attention_bias": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
}


def test_35b_flavor_is_the_official_config_and_has_its_exact_parameter_count():
    """34,660,610,688 text parameters, counted by hand from the official config:
    embedding + lm_head 2 * 248320 * 2048; final norm 2048; per layer two norms (4096) and the MoE block
    (router 256*2048, experts 256*(2*512)*2048 + 256*2048*512, shared expert 3*2048*512, its gate 2048);
    10 attention layers (q 2048*16*256*2, k and v 2048*2*256 each, o 16*256*2048, q/k norms 2*256);
    30 Gated DeltaNet layers (qkv 2048*8192, z 2048*4096, a and b 2048*32 each, conv 8192*4, A_log and dt_bias
    32 each, norm 128, out 4096*2048). Dropping any component (e.g. the shared experts, 123M) changes it.
    The MTP layer (transformers has none) adds fc 4096*2048, three norms and one attention layer with its MoE."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    official = Qwen35MoeArgs.from_hf_config(OFFICIAL_35B_A3B_TEXT_CONFIG)
    # The flavor is the official config, its MTP layer included
    assert official.mtp_num_hidden_layers == 1
    assert get_flavor("35B-A3B") == official
    moe = 256 * 2048 + 256 * 1024 * 2048 + 256 * 2048 * 512 + 3 * 2048 * 512 + 2048
    attention = 2048 * 8192 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 256
    gdn = 2048 * 8192 + 2048 * 4096 + 2 * 2048 * 32 + 8192 * 4 + 2 * 32 + 128 + 4096 * 2048
    by_hand = 2 * 248320 * 2048 + 2048 + 40 * (4096 + moe) + 10 * attention + 30 * gdn
    assert by_hand == 34_660_610_688

    with torch.device("meta"):
        ours = Qwen35MoeModel(official)
        theirs = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**OFFICIAL_35B_A3B_TEXT_CONFIG))
    mtp = 4096 * 2048 + 3 * 2048 + 4096 + moe + attention
    assert sum(p.numel() for p in ours.parameters()) == by_hand + mtp
    assert sum(p.numel() for p in ours.parameters() if p not in set(ours.mtp.parameters())) == by_hand
    assert sum(p.numel() for p in theirs.parameters()) == by_hand


def test_text_only_and_multimodal_configs_give_the_same_args():
    text = Qwen35MoeArgs.from_hf_config(TINY_HF_CONFIG)
    nested = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "text_config": copy.deepcopy(TINY_HF_CONFIG)}
    assert Qwen35MoeArgs.from_hf_config(nested) == text
    assert text.rotary_dim == 8 and text.rope_theta == 10000.0 and text.mrope_section == [2, 1, 1]


def test_flat_rope_fields_and_interval_are_read():
    cfg = {k: v for k, v in TINY_HF_CONFIG.items() if k not in ("rope_parameters", "layer_types")}
    cfg.update(rope_theta=5e6, partial_rotary_factor=0.25, full_attention_interval=2)
    a = Qwen35MoeArgs.from_hf_config(cfg)
    assert a.rope_theta == 5e6 and a.rotary_dim == 4
    assert a.layer_types == ["linear_attention", "full_attention"] * 2


def test_to_hf_config_round_trips_and_transformers_accepts_it():
    from transformers import Qwen3_5MoeTextConfig

    a = Qwen35MoeArgs.from_hf_config(TINY_HF_CONFIG)
    cfg = a.to_hf_config()
    assert Qwen35MoeArgs.from_hf_config(cfg) == a
    hf = Qwen3_5MoeTextConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "dtype")})
    assert hf.layer_types == a.layer_types and hf.num_experts == a.num_experts


def test_config_json_path_and_folder(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    assert Qwen35MoeArgs.from_hf_config(tmp_path) == Qwen35MoeArgs.from_hf_config(tmp_path / "config.json")
    with pytest.raises(FileNotFoundError):
        Qwen35MoeArgs.from_hf_config(tmp_path / "missing")


def test_invalid_shapes_are_rejected():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Qwen35MoeArgs(num_attention_heads=5, num_key_value_heads=2)
    with pytest.raises(ValueError, match="unknown layer types"):
        Qwen35MoeArgs(num_hidden_layers=1, layer_types=["mamba"])
    with pytest.raises(ValueError, match="rope_type"):
        Qwen35MoeArgs.from_hf_config({**TINY_HF_CONFIG, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="unknown qwen35_moe flavor"):
        get_flavor("7B")


@pytest.mark.parametrize("config, named", [
    ({**TINY_HF_CONFIG, "model_type": "llama"}, "model_type 'llama' is not a Qwen3.5-MoE model"),
    ([TINY_HF_CONFIG], "holds a JSON object, not a JSON list"),
    ({"model_type": "qwen3_5_moe", "text_config": "x"}, "text_config is a JSON str"),
    ({**TINY_HF_CONFIG, "hidden_size": "64", "layer_types": [1]}, "hidden_size = '64' is not int; layer_types"),
    ({**TINY_HF_CONFIG, "num_experts": True}, "num_experts = True is not int"),
    ({**TINY_HF_CONFIG, "hidden_size": -8, "num_key_value_heads": 0}, "hidden_size must be >= 1, got -8; "
                                                                      "num_key_value_heads must be >= 1, got 0"),
])
def test_a_config_json_of_another_model_or_with_values_that_do_not_fit_is_a_value_error_naming_them(config, named,
                                                                                                   tmp_path):
    """Not a traceback from deep inside torch (or a 40-layer model built from defaults) once the run has started:
    run_requirements turns the ValueError into the launch's one error line."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        Qwen35MoeArgs.from_hf_config(tmp_path / "config.json")
    assert named in str(e.value)


def test_a_full_attention_interval_below_1_is_named_not_divided_by():
    cfg = {k: v for k, v in TINY_HF_CONFIG.items() if k != "layer_types"}
    with pytest.raises(ValueError, match="full_attention_interval must be >= 1, got 0"):
        Qwen35MoeArgs.from_hf_config({**cfg, "full_attention_interval": 0})


def test_meta_init_gives_hf_like_init():
    model = initialized_model(get_flavor("debugmodel"))
    gdn = model.layers["0"].linear_attn
    a = gdn.A_log.exp()
    assert torch.all((a >= 0.01 - 1e-6) & (a <= 16 + 1e-4))
    assert torch.all(gdn.dt_bias == 1)
    assert torch.all(gdn.norm.weight == 1)
    assert torch.all(model.norm.weight == 0) and torch.all(model.layers["1"].self_attn.q_norm.weight == 0)
    assert abs(model.embed_tokens.weight.std().item() - 0.02) < 0.002
    assert all(torch.isfinite(p).all() for p in model.parameters())
