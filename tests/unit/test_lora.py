"""LoRA (models/qwen35_moe/lora.py) in float64 against the plain formula: a model whose weights are W + s * B A,
computed from leaf A and B tensors and run through the plain model (no adapter module), gives the LoRA model's
logits and, by autograd through that formula, its gradients of A and B, for the dense targets and the routed
experts alike."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.func import functional_call

from harness.lora.merge import adapter_merges, merged_reads
from models.qwen35_moe import Qwen35MoeModel, get_flavor
from models.qwen35_moe.lora import adapted_modules, add_adapters
from models.qwen35_moe.lora_targets import DEFAULT_TARGETS, TARGETS, LoraArgs
from tests.builders import initialized_model

ARGS = get_flavor("debugmodel_mtp")
EVERY_TARGET = LoraArgs(rank=8, alpha=16.0, targets=TARGETS, mtp=True)


def lora_model(lora: LoraArgs = EVERY_TARGET, seed: int = 0, b_random: bool = True) -> Qwen35MoeModel:
    """The debug model in float64 with adapters; with `b_random`, B away from its zero init (else the model's
    update is zero)."""
    with torch.device("meta"):
        model = Qwen35MoeModel(ARGS)
        add_adapters(model, lora)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    model.double()
    if b_random:
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("lora_B", "_B")):
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
    return model


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ARGS.vocab_size, (2, 24), generator=g)
    position_ids = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)  # two documents a row
    return ids, position_ids


def plain_state(model: Qwen35MoeModel) -> dict[str, torch.Tensor]:
    """The model's base state dict (no adapter keys)."""
    return {k: v for k, v in model.state_dict().items() if ".adapter." not in k}


def test_with_b_zero_the_model_is_the_base_model_exactly():
    model = lora_model(b_random=False)
    base = initialized_model(ARGS).double()
    base.load_state_dict(plain_state(model))
    ids, pos = batch()
    assert torch.equal(model(ids, pos, mtp=True).logits, base(ids, pos, mtp=True).logits)


def test_only_the_adapters_train_and_every_target_gets_one():
    model = lora_model()
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".adapter." in name for name in trained)
    kinds = {name.split(".")[-1] if "shared_expert." not in name else "shared_expert"
             for name, _ in adapted_modules(model)}
    assert kinds == {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b",
                     "out_proj", "shared_expert", "shared_expert_gate", "gate", "experts", "fc"}
    default = lora_model(dataclasses.replace(EVERY_TARGET, targets=DEFAULT_TARGETS, mtp=False))
    assert not any(name.startswith("mtp.") or name.endswith(("gate", "shared_expert_gate", "fc"))
                   for name, _ in adapted_modules(default))


def formula_weights(model: Qwen35MoeModel, factors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """{key of an adapted base weight: W + s * B A}, the plain formula on the A and B tensors `factors` (adapter key ->
    tensor; None: the model's own), per expert for the routed experts (B_e @ A_e), s each adapter's alpha / rank:
    the reference the adapters' forward, gradients and merged exports are held to."""
    factors = factors if factors is not None else {k: v for k, v in model.state_dict().items() if ".adapter." in k}
    weights, merged = model.state_dict(), {}
    for name, module in adapted_modules(model):
        scale = module.adapter.scale
        if name.endswith("experts"):
            for which in ("gate_up", "down"):
                a, b = factors[f"{name}.adapter.{which}_A"], factors[f"{name}.adapter.{which}_B"]
                delta = torch.stack([b[e] @ a[e] for e in range(a.shape[0])])
                merged[f"{name}.{which}_proj"] = weights[f"{name}.{which}_proj"] + scale * delta
        else:
            a, b = factors[f"{name}.adapter.lora_A"], factors[f"{name}.adapter.lora_B"]
            merged[f"{name}.weight"] = weights[f"{name}.weight"] + scale * b @ a
    return merged


def test_logits_and_gradients_of_a_and_b_equal_the_plain_formula():
    model = lora_model()
    ids, pos = batch(1)
    labels = torch.roll(ids, -1, dims=1)
    out = model(ids, pos, labels=labels, mtp=True, mtp_labels=torch.roll(ids, -2, dims=1)[..., None])
    (out.ce_sum + out.mtp_ce_sum).backward()

    base = initialized_model(ARGS).double().requires_grad_(False)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in model.state_dict().items() if ".adapter." in k}
    weights = plain_state(model) | formula_weights(model, leaves)
    ref = functional_call(base, weights, (ids, pos), dict(labels=labels, mtp=True,
                                                            mtp_labels=torch.roll(ids, -2, dims=1)[..., None]))
    torch.testing.assert_close(out.ce_sum, ref.ce_sum, rtol=1e-12, atol=0)
    (ref.ce_sum + ref.mtp_ce_sum).backward()
    params = dict(model.named_parameters())
    for key, leaf in leaves.items():
        # float64: the two paths differ only in the order of their sums (1e-13 relative, measured 1e-15)
        torch.testing.assert_close(params[key].grad, leaf.grad, rtol=1e-10, atol=1e-13, msg=key)
    assert all(p.grad is None for name, p in params.items() if ".adapter." not in name)
    expert_grads = [leaf.grad for key, leaf in leaves.items() if "experts.adapter" in key and key.endswith("_A")]
    assert expert_grads and all(g.abs().sum() > 0 for g in expert_grads)


def test_the_exports_merged_weights_run_as_the_plain_model_give_the_lora_models_logits():
    model = lora_model()
    base = initialized_model(ARGS).double()
    state = model.state_dict()
    merges = adapter_merges(state, EVERY_TARGET.scale_of)
    read = merged_reads(state.__getitem__, merges, torch.float64)  # the merge the HF exports write
    base.load_state_dict(plain_state(model) | {key: read(key) for key in merges})
    ids, pos = batch(2)
    torch.testing.assert_close(base(ids, pos, mtp=True).logits, model(ids, pos, mtp=True).logits,
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("targets", [("experts",), ("q_proj",)])
def test_the_adapters_keys_are_the_only_new_ones(targets):
    model = lora_model(dataclasses.replace(EVERY_TARGET, targets=targets))
    new = set(model.state_dict()) - set(initialized_model(ARGS).state_dict())
    assert new and all(".adapter." in key for key in new)
