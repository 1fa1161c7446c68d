"""The multi-token-prediction layer: its forward against a float64 reference written from vLLM's definition
(models/qwen35_moe/mtp.py), packed documents, and the `mtp.*` checkpoint names, dtypes and config fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models.qwen35_moe import (
    Qwen35MoeArgs,
    Qwen35MoeStateDictAdapter,
    from_pretrained,
    load_hf_state_dict,
    save_hf_checkpoint,
)
from tests.builders import initialized_model
from tests.hf_reference import TINY_HF_CONFIG, force_transformers_torch_kernels, official_dtypes, per_expert

REPO = Path(__file__).resolve().parents[2]

TINY_MTP_CONFIG = {**TINY_HF_CONFIG, "mtp_num_hidden_layers": 1}
ARGS = Qwen35MoeArgs.from_hf_config(TINY_MTP_CONFIG)

# The text fields of the released Qwen3.5-MoE config.json (the 35B-A3B `text_config`'s keys, as public copies of
# it list them), at the tiny shapes of TINY_HF_CONFIG: the fixture of the config round trip.
OFFICIAL_SHAPED_TEXT_CONFIG = {
    "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "bos_token_id": 248044,
    "dtype": "bfloat16", "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 16, "hidden_act": "silu",
    "hidden_size": 32, "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_value_head_dim": 8,
    "mamba_ssm_dtype": "float32", "max_position_embeddings": 512, "model_type": "qwen3_5_moe_text",
    "moe_intermediate_size": 16, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
    "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4,
    "num_key_value_heads": 2, "output_router_logits": False, "pad_token_id": None, "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-6, "rope_parameters": {"mrope_interleaved": True, "mrope_section": [2, 1, 1],
                                              "partial_rotary_factor": 0.5, "rope_theta": 10000,
                                              "rope_type": "default"},
    "shared_expert_intermediate_size": 24, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 96,
}
OFFICIAL_SHAPED_CONFIG = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
    "text_config": OFFICIAL_SHAPED_TEXT_CONFIG, "tie_word_embeddings": False, "vision_config": {"depth": 1},
}
# What the text-only CausalLM export writes beyond the official text fields: its class, and two training fields
# transformers reads (their defaults in transformers' Qwen3_5MoeTextConfig).
EXPORT_ONLY_FIELDS = {"architectures", "initializer_range", "router_aux_loss_coef"}


def _perturbed_model(args=ARGS, seed=0, dtype=torch.float64):
    """Weights away from their init, so the norms (init 0), router and gates all matter."""
    model = initialized_model(args, seed).to(dtype)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and not name.endswith(("A_log", "dt_bias")):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2)
            elif p.ndim > 1:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    return model


def _ids(seed=1, batch=2, seq=24, vocab=96):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ---- the reference: vLLM's Qwen3_5MultiTokenPredictor.forward in plain float64 torch ops ----

def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def _rope(x, pos, rotary_dim, theta):
    """x (B, S, H, D); rotate-half RoPE on the first rotary_dim channels."""
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    ang = pos.double()[..., None] * inv
    cos, sin = torch.cat((ang, ang), -1).cos()[:, :, None], torch.cat((ang, ang), -1).sin()[:, :, None]
    r, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    r1, r2 = r.chunk(2, -1)
    return torch.cat((r * cos + torch.cat((-r2, r1), -1) * sin, rest), -1)


def _reference_mtp(sd, args, hidden, ids, positions):
    """hidden: the main model's final-normed states; ids (B, S); positions (B, S) restarting per document."""
    p = "mtp."
    B, S, D = hidden.shape
    nxt = torch.cat((ids[:, 1:], ids[:, -1:]), 1)
    emb = sd["embed_tokens.weight"][nxt]
    x = torch.cat((_rms(emb, sd[p + "pre_fc_norm_embedding.weight"]), _rms(hidden, sd[p + "pre_fc_norm_hidden.weight"])), -1)
    x = x @ sd[p + "fc.weight"].T
    lp = p + "layers.0."
    # gated attention
    H, KV, hd = args.num_attention_heads, args.num_key_value_heads, args.head_dim
    a = _rms(x, sd[lp + "input_layernorm.weight"])
    qg = (a @ sd[lp + "self_attn.q_proj.weight"].T).view(B, S, H, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(B, S, H * hd)
    k = (a @ sd[lp + "self_attn.k_proj.weight"].T).view(B, S, KV, hd)
    v = (a @ sd[lp + "self_attn.v_proj.weight"].T).view(B, S, KV, hd)
    q, k = _rms(q, sd[lp + "self_attn.q_norm.weight"]), _rms(k, sd[lp + "self_attn.k_norm.weight"])
    q, k = _rope(q, positions, args.rotary_dim, args.rope_theta), _rope(k, positions, args.rotary_dim, args.rope_theta)
    k, v = k.repeat_interleave(H // KV, 2), v.repeat_interleave(H // KV, 2)
    doc = (positions == 0).cumsum(1)
    allowed = (doc[:, :, None] == doc[:, None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / hd**0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    attn = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(B, S, H * hd)
    x = x + (attn * torch.sigmoid(gate)) @ sd[lp + "self_attn.o_proj.weight"].T
    # sparse MoE with shared expert
    m = _rms(x, sd[lp + "post_attention_layernorm.weight"]).reshape(B * S, D)
    probs = (m @ sd[lp + "mlp.gate.weight"].T).softmax(-1)
    w, sel = probs.topk(args.num_experts_per_tok, -1)
    w = w / w.sum(-1, keepdim=True)
    gate_up, down = sd[lp + "mlp.experts.gate_up_proj"], sd[lp + "mlp.experts.down_proj"]
    routed = torch.zeros_like(m)
    for n in range(B * S):
        for slot in range(sel.shape[1]):
            e = sel[n, slot]
            g_, u_ = (gate_up[e] @ m[n]).chunk(2)
            routed[n] += w[n, slot] * (down[e] @ (F.silu(g_) * u_))
    se = lp + "mlp.shared_expert."
    shared = (F.silu(m @ sd[se + "gate_proj.weight"].T) * (m @ sd[se + "up_proj.weight"].T)) @ sd[se + "down_proj.weight"].T
    shared = torch.sigmoid(m @ sd[lp + "mlp.shared_expert_gate.weight"].T) * shared
    x = x + (routed + shared).view(B, S, D)
    return _rms(x, sd[p + "norm.weight"])


def _final_hidden(model, ids, positions):
    captured = {}
    handle = model.norm.register_forward_hook(lambda m, i, out: captured.setdefault("h", out))
    with torch.no_grad():
        out = model(ids, positions, mtp=True)
    handle.remove()
    return out, captured["h"]


def test_mtp_forward_matches_float64_reference_with_packed_documents():
    model = _perturbed_model()
    ids = _ids()
    positions = torch.stack((torch.cat((torch.arange(10), torch.arange(14))), torch.arange(24)))
    out, hidden = _final_hidden(model, ids, positions)
    ref = _reference_mtp(model.state_dict(), ARGS, hidden, ids, positions)
    # Float64 but for RoPE, which rope.py computes in fp32 by design (~3e-8 here); a wrong definition (concat order,
    # which hidden state, norm form, positions) is off by O(0.1).
    torch.testing.assert_close(out.mtp_hidden[0], ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model.lm_head(out.mtp_hidden[0]), ref @ model.lm_head.weight.T, rtol=1e-6, atol=1e-6)


def test_mtp_of_packed_documents_equals_each_document_alone():
    """Attention in the MTP layer stays inside each document: every position but a document's last (whose x_{t+1}
    is the next document's first token, a target to ignore) gets the output of its document run alone."""
    model = _perturbed_model()
    a, b = _ids(seed=2, batch=1, seq=11), _ids(seed=3, batch=1, seq=9)
    positions = torch.cat((torch.arange(11), torch.arange(9)))[None]
    with torch.no_grad():
        packed = model(torch.cat((a, b), 1), positions, mtp=True).mtp_hidden[0]
        alone = [model(x, mtp=True).mtp_hidden[0] for x in (a, b)]
    torch.testing.assert_close(packed[:, :10], alone[0][:, :10], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(packed[:, 11:19], alone[1][:, :8], rtol=1e-10, atol=1e-10)


def test_model_without_mtp_is_unchanged_and_refuses_mtp():
    """An MTP layer adds parameters of its own only: the main weights (drawn per name) and logits are the same."""
    with_mtp, without = initialized_model(ARGS, seed=4), initialized_model(Qwen35MoeArgs.from_hf_config(TINY_HF_CONFIG), seed=4)
    ids = _ids(seed=5)
    with torch.no_grad():
        plain = with_mtp(ids)
        assert plain.mtp_hidden is None
        assert torch.equal(plain.logits, without(ids).logits)
        assert torch.equal(with_mtp(ids, mtp=True).logits, plain.logits)
    assert without.mtp is None and not any(k.startswith("mtp.") for k in without.state_dict())
    with pytest.raises(ValueError, match="no MTP layer"):
        without(ids, mtp=True)


def test_mtp_norms_start_at_identity_and_fc_is_random():
    model = initialized_model(ARGS)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert torch.all(getattr(model.mtp, name).weight == 0)  # zero-centred: scale 1 + w
    assert model.mtp.fc.weight.shape == (32, 64) and model.mtp.fc.weight.std() > 0


# ---- checkpoint names, dtypes, config ----

def _official_text_only(model) -> dict:
    """The model's HF tensors in the official dtypes (bf16 but the fp32 GDN tensors), main experts fused, the MTP
    layer's per expert (the release's layout)."""
    return official_dtypes(Qwen35MoeStateDictAdapter(ARGS).to_hf(model.state_dict()))


def _multimodal(hf: dict) -> dict:
    """The release's layout: text under model.language_model., mtp.* and lm_head at the top level."""
    out = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v for k, v in hf.items()}
    out["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    return out


def _mtp_experts_fused(hf: dict) -> dict:
    """The MTP layer's experts fused, as later releases (Qwen3.6) store them."""
    base = "mtp.layers.0.mlp.experts."
    out = {k: v for k, v in hf.items() if not k.startswith(base)}
    experts = range(ARGS.num_experts)
    out[base + "gate_up_proj"] = torch.stack([torch.cat((hf[f"{base}{e}.gate_proj.weight"],
                                                         hf[f"{base}{e}.up_proj.weight"])) for e in experts])
    out[base + "down_proj"] = torch.stack([hf[f"{base}{e}.down_proj.weight"] for e in experts])
    return out


def test_mtp_keys_are_exported_under_their_official_names_and_dtypes():
    """As the release: mtp.* at the top level, the MTP layer's experts per expert (gate and up the two halves of the
    native gate_up_proj, down its down_proj), every tensor in the export dtype."""
    model = initialized_model(ARGS)
    hf = _official_text_only(model)
    mtp = sorted(k for k in hf if k.startswith("mtp."))
    assert "mtp.fc.weight" in mtp and "mtp.norm.weight" in mtp
    assert {"mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"} <= set(mtp)
    assert not any(k.startswith("model.mtp") for k in hf)
    assert not {"mtp.layers.0.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts.down_proj"} & set(hf)
    assert all(hf[k].dtype == torch.bfloat16 for k in mtp)
    gate_up, down = (model.state_dict()[f"mtp.layers.0.mlp.experts.{n}"].bfloat16()
                     for n in ("gate_up_proj", "down_proj"))
    inter = ARGS.moe_intermediate_size
    for e in range(ARGS.num_experts):
        expert = f"mtp.layers.0.mlp.experts.{e}."
        assert torch.equal(hf[expert + "gate_proj.weight"], gate_up[e, :inter])
        assert torch.equal(hf[expert + "up_proj.weight"], gate_up[e, inter:])
        assert torch.equal(hf[expert + "down_proj.weight"], down[e])
    assert len([k for k in mtp if k.startswith("mtp.layers.0.mlp.experts.")]) == 3 * ARGS.num_experts


@pytest.mark.parametrize("layout", ["release", "mtp_fused", "per_expert", "multimodal_per_expert"])
def test_official_layouts_with_mtp_round_trip_tensor_for_tensor(layout):
    adapter = Qwen35MoeStateDictAdapter(ARGS)
    official = _official_text_only(_perturbed_model(dtype=torch.float32))
    source = {"release": official, "mtp_fused": _mtp_experts_fused(official), "per_expert": per_expert(official),
              "multimodal_per_expert": _multimodal(per_expert(official))}[layout]
    back = adapter.to_hf(adapter.from_hf(source))
    assert back.keys() == official.keys()
    for k, v in official.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_checkpoint_without_mtp_names_the_fix():
    adapter = Qwen35MoeStateDictAdapter(ARGS)
    hf = {k: v for k, v in _official_text_only(initialized_model(ARGS)).items() if not k.startswith("mtp.")}
    with pytest.raises(ValueError, match=r"missing keys: mtp\..*mtp_num_hidden_layers 0"):
        adapter.from_hf(hf)


def test_config_json_export_keeps_every_official_field():
    args = Qwen35MoeArgs.from_hf_config(OFFICIAL_SHAPED_CONFIG)
    assert args.mtp_num_hidden_layers == 1
    exported = args.to_hf_config("bfloat16")
    official = OFFICIAL_SHAPED_TEXT_CONFIG
    assert set(exported) - set(official) == EXPORT_ONLY_FIELDS
    assert set(official) <= set(exported)
    for key, value in official.items():
        assert exported[key] == value, key
    assert exported["architectures"] == ["Qwen3_5MoeForCausalLM"]
    flipped = Qwen35MoeArgs.from_hf_config({**OFFICIAL_SHAPED_TEXT_CONFIG, "use_cache": False, "mtp_num_hidden_layers": 0})
    assert flipped.to_hf_config()["use_cache"] is False and flipped.to_hf_config()["mtp_num_hidden_layers"] == 0


def test_unsupported_mtp_and_gate_fields_are_refused():
    with pytest.raises(ValueError, match="mtp_use_dedicated_embeddings"):
        Qwen35MoeArgs.from_hf_config({**TINY_MTP_CONFIG, "mtp_use_dedicated_embeddings": True})
    with pytest.raises(ValueError, match="attn_output_gate"):
        Qwen35MoeArgs.from_hf_config({**TINY_MTP_CONFIG, "attn_output_gate": False})


def test_export_with_mtp_reloads_exactly_and_loads_in_transformers(tmp_path, monkeypatch):
    """The folder holds mtp.* beside the text model; from_pretrained gets every tensor back, MTP included, and
    transformers (which has no MTP) loads the folder, ignoring mtp.*, with our logits."""
    from transformers import Qwen3_5MoeForCausalLM

    force_transformers_torch_kernels(monkeypatch)
    model = _perturbed_model(dtype=torch.float32)
    save_hf_checkpoint(model.state_dict(), ARGS, tmp_path / "hf", dtype=torch.float32)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1 and config["mtp_use_dedicated_embeddings"] is False
    assert any(k.startswith("mtp.") for k in load_hf_state_dict(tmp_path / "hf"))
    loaded = from_pretrained(tmp_path / "hf")
    assert loaded.mtp is not None
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k

    reloaded = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = _ids(seed=6)
    with torch.no_grad():
        diff = (reloaded(input_ids=ids).logits - model(ids).logits).abs().max().item()
    assert diff < 1e-4, f"max |logits diff| {diff:.3e}"


@pytest.mark.parametrize("coef", ["0", "0.1"])
def test_a_run_resumes_and_exports_the_mtp_layer_frozen_or_trained(tmp_path, coef):
    """training.mtp_loss_coef 0: a run of a model with an MTP layer keeps it as loaded (no gradient, no optimizer
    state), the export's mtp.* equal to the initial weights (a fresh model of the same seed, exported the same way).
    0.1: the MTP layer is trained, its optimizer state checkpointed: 2 steps, then a relaunch to 4, export the same
    weights, mtp.* included, as 4 steps in one go."""
    import dataclasses
    import json

    from safetensors.torch import load_file

    from harness.checkpoint.hf_weights import export_hf
    from harness.train import main
    from models.qwen35_moe import Qwen35MoeArgs, Qwen35MoeModel, get_flavor

    args = dataclasses.replace(get_flavor("debugmodel"), mtp_num_hidden_layers=1)
    (tmp_path / "config.json").write_text(json.dumps(args.to_hf_config()))

    def flags(out):
        return ["--model.hf_config", str(tmp_path / "config.json"), "--training.seq_len", "64",
                "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false", "--checkpoint.enable",
                "true", "--checkpoint.interval", "2", "--checkpoint.export_hf_at_end", "true",
                "--checkpoint.export_dtype", "float32", "--training.mtp_loss_coef", coef, "--job.dump_folder", str(out),
                # a constant lr: the same schedule for 2 steps then 4 as for 4 at once
                "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_ratio", "0",
                "--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "1",
                "--validation.dataset_path", str(REPO / "data" / "debug_corpus" / "train.jsonl")]

    assert main([*flags(tmp_path / "out"), "--training.steps", "2"]) == 0
    assert main([*flags(tmp_path / "out"), "--training.steps", "4"]) == 0  # resumes
    fresh = Qwen35MoeModel(Qwen35MoeArgs.from_hf_config(str(tmp_path / "config.json")))
    fresh.init_weights(42)  # debug_model.toml's training.seed
    export_hf(fresh, fresh.args, str(tmp_path / "fresh"), torch.float32)
    trained = load_file(tmp_path / "out" / "hf" / "model.safetensors")
    initial = load_file(tmp_path / "fresh" / "model.safetensors")
    mtp_keys = [k for k in initial if k.startswith("mtp.")]
    assert mtp_keys
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    # held out, trained or frozen: the MTP layer's loss beside the model's
    assert [r["step"] for r in records if "val_mtp_loss" in r] == [2, 4]
    assert all(("mtp_loss" in r) == (coef != "0") for r in records if "loss" in r)
    assert not torch.equal(trained["model.layers.0.mlp.gate.weight"], initial["model.layers.0.mlp.gate.weight"])
    if coef == "0":
        assert all(torch.equal(trained[k], initial[k]) for k in mtp_keys)
        return
    assert all(not torch.equal(trained[k], initial[k]) for k in mtp_keys)
    assert main([*flags(tmp_path / "whole"), "--training.steps", "4"]) == 0
    whole = load_file(tmp_path / "whole" / "hf" / "model.safetensors")
    assert whole.keys() == trained.keys() and all(torch.equal(whole[k], trained[k]) for k in whole)


def test_a_trained_mtp_layer_predicts_the_token_after_next_and_transformers_loads_the_export(tmp_path, monkeypatch):
    """The debug model with one MTP layer trained on the debug corpus: on documents from the corpus's end (past the
    rows these steps read), its x_{t+2} predictions beat both chance and a predictor that knows every byte's
    frequency in the corpus (cross entropy below the unigram entropy, top-1 accuracy above the most frequent
    byte's share). transformers loads the export (leaving mtp.* aside) and computes the same next-token logits."""
    from transformers import AutoModelForCausalLM

    from harness.checkpoint.hf_weights import load_hf_weights
    from harness.train import main
    from models.qwen35_moe import Qwen35MoeModel, get_flavor

    out = tmp_path / "out"
    assert main(["--config", str(REPO / "train_configs" / "debug_model.toml"), "--model.flavor", "debugmodel_mtp",
                 "--training.steps", "80", "--training.seq_len", "128", "--training.mtp_loss_coef", "0.3",
                 "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(out)]) == 0
    args = get_flavor("debugmodel_mtp")
    model = Qwen35MoeModel(args)
    load_hf_weights(model, args, str(out / "hf"))  # mtp.* included
    model.eval()

    lines = (REPO / "data" / "debug_corpus" / "train.jsonl").read_text().splitlines()
    counts = torch.bincount(torch.tensor(list("".join(json.loads(line)["text"] for line in lines).encode())),
                            minlength=args.vocab_size).double()
    log_unigram = (counts / counts.sum()).clamp_min(1e-12).log()
    mtp_ce = unigram_ce = correct = frequent = targets = 0.0
    with torch.no_grad():
        for line in lines[-20:]:  # 80 steps of 8 x 128 tokens read the first ~82 kB of the 1 MB corpus
            ids = torch.tensor(list(json.loads(line)["text"].encode()[:512]))[None]
            logits = model.lm_head(model(ids, mtp=True).mtp_hidden[0][0, :-2]).double()  # x_{t+2} of t < S - 2
            wanted = ids[0, 2:]
            mtp_ce += F.cross_entropy(logits, wanted, reduction="sum").item()
            unigram_ce -= log_unigram[wanted].sum().item()
            correct += (logits.argmax(-1) == wanted).sum().item()
            frequent += (wanted == counts.argmax()).sum().item()
            targets += wanted.numel()
    # Measured: MTP 2.53 nats, unigram 3.29, chance ln 512 = 6.24; top-1 accuracy 0.33 against 0.20 (the space).
    assert mtp_ce / targets < unigram_ce / targets - 0.4
    assert correct / targets > frequent / targets + 0.08

    # The validator's greedy acceptance of the first draft against the full logits, by hand: at t, the MTP's argmax
    # for x_{t+2} against the main model's argmax at t + 1
    from harness.validation import draft_matches
    from models.qwen35_moe.mtp import mtp_rows

    window = torch.tensor(list(json.loads(lines[-1])["text"].encode()[:301]))[None]
    ids, labels, positions = window[:, :-1], window[:, 1:], torch.arange(300)[None]
    rows = mtp_rows(ids, labels, positions, 1)
    with torch.no_grad():
        forward = model(ids, positions, labels=labels, mtp=True, return_hidden=True, loss_chunk_tokens=64, **rows)
        accepted, drafted = draft_matches(model, {**rows, "loss_chunk_tokens": 64}, forward)
        main = model(ids, positions).logits[0].argmax(-1)
        draft = model.lm_head(model(ids, positions, mtp=True).mtp_hidden[0][0]).argmax(-1)
    by_hand = sum(int(draft[t] == main[t + 1]) for t in range(299))
    assert (accepted.item(), drafted.item()) == (by_hand, 299)
    assert by_hand / 299 > 0.35  # measured 0.53: the trained head agrees with the model it drafts for

    force_transformers_torch_kernels(monkeypatch)
    hf = AutoModelForCausalLM.from_pretrained(out / "hf").eval()  # float32, as exported
    ids = torch.tensor(list(b"Once upon a time, Tara read a book."))[None]
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


def test_mtp_rows_target_the_token_after_next_within_each_document_only():
    """mtp_rows against a loop over every position of packed rows with documents and masked labels, two depths:
    depth k at t embeds x_{t+k+1} and targets x_{t+k+2} only if x_{t+1} ... x_{t+k+2} lie in x_t's document, inside
    the row's window, and the label is not masked."""
    from models.qwen35_moe.mtp import mtp_rows

    gen = torch.Generator().manual_seed(0)
    batch, seq, depth = 3, 40, 2
    window = torch.randint(0, 500, (batch, seq + 1), generator=gen)  # the loader's S + 1 tokens of a row
    doc_of = torch.cumsum(torch.rand(batch, seq + 1, generator=gen) < 0.15, dim=1)  # document index of each token
    doc_of[:, 0] = 0
    positions = torch.stack([torch.tensor([t - (doc_of[b, :t + 1] == doc_of[b, t]).nonzero()[0].item()
                                           for t in range(seq)]) for b in range(batch)])
    labels = window[:, 1:].clone()
    labels[doc_of[:, 1:] != doc_of[:, :-1]] = -100  # as the loader masks a token that opens another document
    labels[torch.rand(batch, seq, generator=gen) < 0.2] = -100  # a target mask (chat rows)
    rows = mtp_rows(window[:, :-1], labels, positions, depth)
    for b in range(batch):
        for t in range(seq):
            for k in range(depth):
                assert rows["mtp_input_ids"][b, t, k] == window[b, min(t + k + 1, seq - 1)]
                target = t + k + 2  # index of x_{t+k+2} in the window
                valid = (target <= seq and all(doc_of[b, u] == doc_of[b, t] for u in range(t, target + 1))
                         and labels[b, target - 1] != -100)
                assert rows["mtp_labels"][b, t, k] == (window[b, target] if valid else -100), (b, t, k)


def test_mtp_under_context_parallelism_needs_the_shifted_ids_of_the_whole_rows():
    model = initialized_model(Qwen35MoeArgs.from_hf_config(TINY_MTP_CONFIG))
    model.context_parallel = object()  # any CP group: refused before it is used
    with pytest.raises(ValueError, match="mtp_input_ids from the whole rows"):
        model(torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None], mtp=True)


def test_draft_acceptance_under_context_parallelism_shifts_across_the_zigzag_chunks():
    """draft_matches on each CP rank's zigzag chunks counts, summed over the ranks, what a loop over the whole rows
    counts: the main model's pick at t + 1 often lies in another chunk, on another rank."""
    import types

    from harness.validation import draft_matches
    from parallel.context_parallel import shard_zigzag

    gen = torch.Generator().manual_seed(0)
    batch, seq, vocab, cp = 2, 16, 7, 2
    main = torch.randint(0, vocab, (batch, seq), generator=gen)
    draft = torch.randint(0, vocab, (batch, seq), generator=gen)
    agree = torch.rand(batch, seq, generator=gen) < 0.5
    draft[:, :-1] = torch.where(agree[:, :-1], main[:, 1:], draft[:, :-1])
    labels = torch.where(torch.rand(batch, seq, generator=gen) < 0.8, 1, -100)
    labels[:, -1] = -100  # no x_{t+2} for the last position
    want = sum(int(draft[b, t] == main[b, t + 1]) for b in range(batch) for t in range(seq - 1) if labels[b, t] != -100)

    one_hot = lambda picks: F.one_hot(picks, vocab).float()  # noqa: E731  (logits whose argmax is the pick)
    got = 0
    for rank in range(cp):
        local = lambda t: shard_zigzag(t, cp, rank)  # noqa: E731

        def gather_sequence(x, rank=rank):
            assert torch.equal(x, local(main))  # this rank's picks, in its zigzag order
            return main

        model = types.SimpleNamespace(lm_head=torch.nn.Identity(), context_parallel=types.SimpleNamespace(
            size=cp, rank=rank, gather_sequence=gather_sequence))
        out = types.SimpleNamespace(hidden=local(one_hot(main)), mtp_hidden=[local(one_hot(draft))])
        accepted, drafted = draft_matches(model, {"mtp_labels": local(labels)[..., None], "loss_chunk_tokens": 5}, out)
        got += accepted.item()
    assert got == want and want > 5


def test_a_run_frozen_then_relaunched_with_the_mtp_loss_starts_the_mtp_optimizer_state_afresh(tmp_path):
    """training.mtp_loss_coef 0 for 2 steps, then a relaunch at 0.1: the checkpoint holds no optimizer state for the
    MTP layers. The relaunch loads every other parameter's (their step counts go on from 2) and gives the MTP's none,
    as before a first step (its first step is step 1 of its own), instead of failing to load."""
    from harness.config import load_config
    from harness.train import main
    from harness.trainer import Trainer

    flags = ["--config", str(REPO / "train_configs" / "debug_model.toml"), "--model.flavor", "debugmodel_mtp",
             "--training.seq_len", "64", "--training.local_batch_size", "2", "--metrics.enable_tensorboard", "false",
             "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--job.dump_folder", str(tmp_path)]
    assert main([*flags, "--training.steps", "2", "--training.mtp_loss_coef", "0"]) == 0
    trainer = Trainer(load_config([*flags, "--training.steps", "3", "--training.mtp_loss_coef", "0.1"]))
    try:
        assert trainer.step == 2
        named = dict(trainer.model.named_parameters())
        mtp = [p for name, p in named.items() if name.startswith("mtp.")]
        rest = [p for name, p in named.items() if not name.startswith("mtp.")]
        assert mtp and all(p.requires_grad and p not in trainer.optimizer.state for p in mtp)
        assert all(trainer.optimizer.state[p]["step"].item() == 2 for p in rest)
        out = trainer.train_step([next(iter(trainer.dataloader))]).read()
        assert "mtp_loss" in out
        assert all(trainer.optimizer.state[p]["step"].item() == 1 for p in mtp)
        assert all(trainer.optimizer.state[p]["step"].item() == 3 for p in rest)
    finally:
        trainer.close()
