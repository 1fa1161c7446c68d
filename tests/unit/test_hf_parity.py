"""Our native model against transformers' Qwen3_5MoeForCausalLM with the same weights (fp32, torch kernels)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from models.qwen35_moe import Qwen35MoeStateDictAdapter, from_pretrained, save_hf_checkpoint
from tests.builders import initialized_model
from tests.hf_reference import TINY_HF_CONFIG, build_hf_model, force_transformers_torch_kernels

# fp32 end to end; the two models order a few reductions differently (chunked vs whole-sequence
# GDN, SDPA vs eager attention, grouped vs per-expert MoE), which costs ~1e-6 relative per op.
LOGITS_ATOL = 1e-4


@pytest.fixture
def hf_pair(tmp_path, monkeypatch):
    force_transformers_torch_kernels(monkeypatch)
    hf = build_hf_model(TINY_HF_CONFIG)
    hf.save_pretrained(tmp_path / "hf")
    native = from_pretrained(tmp_path / "hf")
    return hf, native


def _inputs(seed=1, batch=2, seq=100):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY_HF_CONFIG["vocab_size"], (batch, seq), generator=g)


def test_logits_match_transformers(hf_pair):
    hf, native = hf_pair
    ids = _inputs()  # 100 tokens: spans two 64-token GDN chunks
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        out = native(ids).logits
    assert out.shape == ref.shape == (2, 100, TINY_HF_CONFIG["vocab_size"])
    diff = (out - ref).abs().max().item()
    assert diff < LOGITS_ATOL, f"max |logits diff| {diff:.3e}"


def test_loss_gradients_match_transformers(hf_pair):
    hf, native = hf_pair
    ids = _inputs(seed=2, seq=80)
    labels = _inputs(seed=3, seq=80)
    vocab = TINY_HF_CONFIG["vocab_size"]

    F.cross_entropy(hf(input_ids=ids).logits.reshape(-1, vocab), labels.reshape(-1)).backward()
    F.cross_entropy(native(ids).logits.reshape(-1, vocab), labels.reshape(-1)).backward()

    adapter = Qwen35MoeStateDictAdapter(native.args)
    ref_grads = adapter.from_hf({n: p.grad for n, p in hf.named_parameters()})
    worst = 0.0
    for name, p in native.named_parameters():
        ref = ref_grads[name]
        # Relative to the gradient's own scale: grads of different tensors span orders of magnitude.
        rel = ((p.grad - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        worst = max(worst, rel)
        assert rel < 1e-4, f"{name}: relative grad error {rel:.3e}"
    assert worst < 1e-4


def test_tied_embeddings_are_one_parameter_with_transformers_gradient(tmp_path, monkeypatch):
    """tie_word_embeddings: loaded from an HF folder (built on the meta device, then materialised), the lm_head is
    the embedding, one parameter whose gradient sums both uses, as in transformers; and the training path's
    model (meta, to_empty, init) keeps the tie too. Before, materialising gave the two modules a parameter each:
    the tied model trained two matrices."""
    force_transformers_torch_kernels(monkeypatch)
    hf = build_hf_model({**TINY_HF_CONFIG, "tie_word_embeddings": True})
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    hf.save_pretrained(tmp_path / "hf")
    native = from_pretrained(tmp_path / "hf")
    assert native.lm_head.weight is native.embed_tokens.weight
    ids, labels, vocab = _inputs(seed=2, seq=80), _inputs(seed=3, seq=80), TINY_HF_CONFIG["vocab_size"]
    F.cross_entropy(hf(input_ids=ids).logits.reshape(-1, vocab), labels.reshape(-1)).backward()
    F.cross_entropy(native(ids).logits.reshape(-1, vocab), labels.reshape(-1)).backward()
    ref = hf.model.embed_tokens.weight.grad
    rel = ((native.embed_tokens.weight.grad - ref).norm() / ref.norm()).item()
    assert rel < 1e-4, f"tied embedding: relative grad error {rel:.3e}"

    trained = initialized_model(native.args)
    assert trained.lm_head.weight is trained.embed_tokens.weight


def _router_stats(moe, x):
    from models.qwen35_moe.moe import RouterStats

    _, counts, prob_sums = moe(x.unsqueeze(0))
    return RouterStats(counts[None], prob_sums[None], num_tokens=x.shape[0], top_k=moe.top_k)


def test_aux_loss_matches_transformers_single_layer_formula(hf_pair):
    """Our per-layer balance loss equals transformers' load_balancing_loss_func on one layer's logits, and
    the per-rank shares of a batch split in two (pooled counts) sum to transformers' loss of the whole batch."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import load_balancing_loss_func

    from models.qwen35_moe.moe import load_balancing_loss

    _, native = hf_pair
    moe = native.layers["0"].mlp
    x = torch.randn(50, TINY_HF_CONFIG["hidden_size"])
    ref = load_balancing_loss_func((F.linear(x, moe.gate.weight),), moe.num_experts, moe.top_k)
    torch.testing.assert_close(load_balancing_loss(_router_stats(moe, x)), ref, rtol=1e-6, atol=1e-7)

    halves = [_router_stats(moe, part) for part in (x[:20], x[20:])]
    pooled = halves[0].counts + halves[1].counts
    shares = [load_balancing_loss(s, pooled_counts=pooled, pooled_tokens=50) for s in halves]
    torch.testing.assert_close(shares[0] + shares[1], ref, rtol=1e-6, atol=1e-7)


def test_our_hf_export_loads_in_transformers_with_same_logits(hf_pair, tmp_path, monkeypatch):
    from transformers import Qwen3_5MoeForCausalLM

    _, native = hf_pair
    save_hf_checkpoint(native.state_dict(), native.args, tmp_path / "export", dtype=torch.float32)
    reloaded = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager").eval()
    ids = _inputs(seed=4)
    with torch.no_grad():
        diff = (reloaded(input_ids=ids).logits - native(ids).logits).abs().max().item()
    assert diff < LOGITS_ATOL, f"max |logits diff| {diff:.3e}"


def test_packed_documents_match_separate_documents(hf_pair):
    """Packing two documents in one row (position ids restart) gives each document's own logits."""
    _, native = hf_pair
    doc_a, doc_b = _inputs(seed=5, batch=1, seq=70), _inputs(seed=6, batch=1, seq=45)
    packed = torch.cat((doc_a, doc_b), dim=1)
    positions = torch.cat((torch.arange(70), torch.arange(45))).unsqueeze(0)
    with torch.no_grad():
        out = native(packed, positions).logits
        ref = torch.cat((native(doc_a).logits, native(doc_b).logits), dim=1)
    diff = (out - ref).abs().max().item()
    assert diff < 1e-5, f"max |logits diff| {diff:.3e}"


def test_multimodal_checkpoint_layout_loads_the_same_model(hf_pair, tmp_path):
    """A Qwen3_5MoeForConditionalGeneration-style folder (text under model.language_model., vision and
    mtp tensors alongside, config nested in text_config) yields the same native weights."""
    import json

    from safetensors.torch import save_file

    from models.qwen35_moe import load_hf_state_dict

    hf, native = hf_pair
    text = load_hf_state_dict(tmp_path / "hf")
    multimodal = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in text.items()
    }
    multimodal["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    multimodal["mtp.fc.weight"] = torch.zeros(2, 2)
    folder = tmp_path / "mm"
    folder.mkdir()
    save_file(multimodal, str(folder / "model.safetensors"))
    text_config = {k: v for k, v in TINY_HF_CONFIG.items() if k != "architectures"}
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text_config,
        "vision_config": {"depth": 1},
    }
    (folder / "config.json").write_text(json.dumps(config))
    loaded = from_pretrained(folder)
    ref = native.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_bf16_model_keeps_ssm_gate_fp32(hf_pair, tmp_path):
    _, native = hf_pair
    bf16 = copy.deepcopy(native).to(torch.bfloat16)
    layer = bf16.layers["0"].linear_attn
    assert layer.in_proj_qkv.weight.dtype == torch.bfloat16
    assert layer.A_log.dtype == torch.float32 and layer.dt_bias.dtype == torch.float32
    assert torch.equal(layer.A_log, native.layers["0"].linear_attn.A_log)
