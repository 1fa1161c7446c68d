"""Balanced routing for benchmarks (`debug.moe_force_load_balance`, `force_balanced_routing` in models/qwen35_moe/moe.py):
token n of a layer's N tokens goes to experts (n * k + j) mod E, weighted by the router's renormalised probabilities
at those experts. Checked against counting and computing by hand; off by default, the normal routing untouched, and
nothing of it in the checkpoint keys or the HF export."""

import copy
import dataclasses
import json
import logging

import pytest
import torch
import torch.nn.functional as F

from harness.config import ConfigError, JobConfig, load_config
from harness.config.help import config_help
from models.qwen35_moe import get_flavor
from models.qwen35_moe.moe import SparseMoE, force_balanced_routing
from tests.builders import initialized_model

DEBUG = get_flavor("debugmodel")


def _tiny_moe(num_experts: int = 5, top_k: int = 3, seed: int = 0) -> SparseMoE:
    """A float64 SparseMoE with random weights: E = 5 and k = 3, so a token's experts wrap around E."""
    args = dataclasses.replace(DEBUG, hidden_size=6, num_experts=num_experts, num_experts_per_tok=top_k,
                               moe_intermediate_size=4, shared_expert_intermediate_size=3)
    moe = SparseMoE(args).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return moe


def _by_hand(moe: SparseMoE, x: torch.Tensor):
    """Output, counts and probability sums of forced routing, one token at a time from the weights (autograd kept)."""
    num_experts, top_k = moe.num_experts, moe.top_k
    hidden = moe.experts.down_proj.shape[-1]
    tokens = x.reshape(-1, x.shape[-1])
    outputs, counts, prob_sums = [], [0.0] * num_experts, 0
    for n, t in enumerate(tokens):
        probs = torch.softmax(moe.gate.weight @ t, dim=0)
        prob_sums = prob_sums + probs
        ids = [(n * top_k + j) % num_experts for j in range(top_k)]
        total = sum(probs[e] for e in ids)
        out = 0
        for e in ids:
            counts[e] += 1
            gate_up = moe.experts.gate_up_proj[e]
            act = F.silu(gate_up[:hidden] @ t) * (gate_up[hidden:] @ t)
            out = out + probs[e] / total * (moe.experts.down_proj[e] @ act)
        shared = moe.shared_expert
        shared_out = shared.down_proj.weight @ (F.silu(shared.gate_proj.weight @ t) * (shared.up_proj.weight @ t))
        out = out + torch.sigmoid(moe.shared_expert_gate.weight @ t) * shared_out
        outputs.append(out)
    return torch.stack(outputs).reshape(x.shape), torch.tensor(counts, dtype=torch.float32), prob_sums


def test_every_expert_of_every_layer_gets_exactly_n_k_over_e_tokens():
    model = initialized_model(DEBUG)
    assert force_balanced_routing(model) == DEBUG.num_hidden_layers
    ids = torch.randint(0, DEBUG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids)
    per_expert = 2 * 16 * DEBUG.num_experts_per_tok // DEBUG.num_experts
    assert torch.equal(out.router_stats.counts, torch.full((DEBUG.num_hidden_layers, DEBUG.num_experts),
                                                           float(per_expert)))
    # Even counts: every layer's balance loss is top_k (sum over experts of the mean probability is one).
    torch.testing.assert_close(out.aux_loss, torch.tensor(float(DEBUG.num_experts_per_tok)))


def test_counts_differ_by_at_most_one_when_e_does_not_divide_n_k():
    moe = _tiny_moe()  # N = 7, k = 3, E = 5: 21 assignments, 4 or 5 per expert
    moe.force_balanced_routing(True)
    with torch.no_grad():
        _, counts, _ = moe(torch.randn(1, 7, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))
    assert counts.tolist() == [5.0, 4.0, 4.0, 4.0, 4.0]


def test_forced_output_counts_and_gradients_match_a_reference_by_hand():
    moe = _tiny_moe()
    moe.force_balanced_routing(True)
    x = torch.randn(2, 4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))  # token n = b * 4 + s
    out, counts, prob_sums = moe(x)
    want_out, want_counts, want_prob_sums = _by_hand(moe, x)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    assert torch.equal(counts, want_counts)
    torch.testing.assert_close(prob_sums, want_prob_sums, rtol=1e-12, atol=1e-12)

    # The router still learns through the combine weights (and the probability sums of the balance loss).
    grads = torch.autograd.grad((out.square().sum(), prob_sums[0]), list(moe.parameters()), allow_unused=True)
    want = torch.autograd.grad((want_out.square().sum(), want_prob_sums[0]), list(moe.parameters()),
                               allow_unused=True)
    for (name, _), got, ref in zip(moe.named_parameters(), grads, want):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12, msg=name)
    gate_grad = dict(zip([n for n, _ in moe.named_parameters()], grads))["gate.weight"]
    assert gate_grad.abs().sum() > 0


def test_router_weight_gets_a_nonzero_gradient_from_the_output_alone():
    moe = _tiny_moe()
    moe.force_balanced_routing(True)
    out, _, _ = moe(torch.randn(1, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4)))
    out.square().sum().backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().min() > 0


def test_forced_router_compiles_into_one_graph_with_the_token_count_dynamic():
    """No graph break and no host sync: the ids come from torch.arange on the device, shaped by the input alone."""
    moe = _tiny_moe()
    compiled = torch.compile(lambda x: moe.gate(x, balanced=True), backend="aot_eager", fullgraph=True, dynamic=True)
    for tokens in (8, 11):
        x = torch.randn(tokens, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(tokens))
        for got, want in zip(compiled(x), moe.gate(x, balanced=True)):
            assert torch.equal(got, want)


def test_off_by_default_and_the_normal_routing_is_unchanged():
    assert JobConfig().debug.moe_force_load_balance is False
    model = initialized_model(DEBUG)
    assert all(not m.force_balance for m in model.modules() if isinstance(m, SparseMoE))

    fresh = _tiny_moe()
    toggled = copy.deepcopy(fresh)
    assert toggled.force_balance is False
    x = torch.randn(2, 4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    toggled.force_balanced_routing(True)
    forced = toggled(x)
    toggled.force_balanced_routing(False)
    got, want = toggled(x), fresh(x)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert not torch.equal(forced[1], want[1])  # the router's top-k is not the round-robin here


def test_checkpoint_keys_and_hf_export_are_the_same_with_it_on(tmp_path):
    from models.qwen35_moe.hf_checkpoint import save_hf_checkpoint

    plain, forced = initialized_model(DEBUG), initialized_model(DEBUG)
    force_balanced_routing(forced)
    assert list(forced.state_dict()) == list(plain.state_dict())
    for name, model in (("plain", plain), ("forced", forced)):
        save_hf_checkpoint(model.state_dict(), DEBUG, tmp_path / name)
    configs = [json.loads((tmp_path / name / "config.json").read_text()) for name in ("plain", "forced")]
    assert configs[0] == configs[1]
    assert not any("balance" in key and "force" in key for key in configs[1])


def test_build_model_sets_it_on_every_layer_and_warns(caplog):
    from harness.model_setup import build_model

    cfg = load_config(["--debug.moe_force_load_balance", "true"])
    with caplog.at_level(logging.WARNING, logger="harness.model_setup"):
        model = build_model(cfg, DEBUG, None, torch.device("cpu"), load_hf=False)
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert len(moes) == DEBUG.num_hidden_layers and all(m.force_balance for m in moes)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("moe_force_load_balance" in w and "benchmarks only" in w for w in warnings), warnings

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="harness.model_setup"):
        model = build_model(load_config([]), DEBUG, None, torch.device("cpu"), load_hf=False)
    assert not any(m.force_balance for m in model.modules() if isinstance(m, SparseMoE))
    assert not any("moe_force_load_balance" in r.getMessage() for r in caplog.records)


# --- config --------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,expected", [
    (["--debug.moe_force_load_balance", "true"], True),
    (["--debug.moe_force_load_balance=1"], True),
    (["--debug.moe_force_load_balance", "false"], False),
    ([], False),
])
def test_key_parses_from_the_command_line(argv, expected):
    assert load_config(argv).debug.moe_force_load_balance is expected


def test_key_parses_from_toml_and_the_command_line_overrides_it(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[debug]\nmoe_force_load_balance = true\n")
    assert load_config(["--config", str(path)]).debug.moe_force_load_balance is True
    assert load_config(["--config", str(path), "--debug.moe_force_load_balance", "no"]).debug.moe_force_load_balance is False


@pytest.mark.parametrize("toml", ["moe_force_load_balance = 1\n", 'moe_force_load_balance = "yes"\n'])
def test_a_non_bool_in_toml_is_rejected(tmp_path, toml):
    path = tmp_path / "typed.toml"
    path.write_text("[debug]\n" + toml)
    with pytest.raises(ConfigError) as e:
        load_config(["--config", str(path)])
    assert "typed.toml" in str(e.value) and "debug.moe_force_load_balance" in str(e.value)


def test_a_bad_bool_on_the_command_line_is_rejected():
    with pytest.raises(ConfigError, match="debug.moe_force_load_balance"):
        load_config(["--debug.moe_force_load_balance=maybe"])


def test_help_shows_the_key_with_its_comment():
    help_text = config_help([])
    line = next(line for line in help_text.splitlines() if "--debug.moe_force_load_balance" in line)
    assert "bool" in line and "false" in line
    assert "benchmarks only" in help_text
