"""Initial weights: the rules of models/qwen35_moe/init.py, reproducible from the seed, independent of wrappers.
(Independence from the world size and mesh: tests/distributed/test_fsdp.py.)"""

import math

import torch

from models.qwen35_moe import get_flavor
from parallel.parallelize import parallelize_qwen35_moe
from tests.builders import initialized_model

ARGS = get_flavor("debugmodel")


def test_each_parameter_follows_its_rule():
    model = initialized_model(ARGS, seed=3)
    std = ARGS.initializer_range
    for name, p in model.state_dict().items():
        if name.endswith("A_log"):
            assert (p.exp() >= 0.01 - 1e-6).all() and (p.exp() <= 16 + 1e-4).all() and p.std() > 0.1, name
        elif name.endswith(("dt_bias", "linear_attn.norm.weight")):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith("norm.weight"):
            assert torch.equal(p, torch.zeros_like(p)), name
        elif name.endswith("conv1d.weight"):
            bound = 1 / math.sqrt(ARGS.linear_conv_kernel_dim)
            assert p.abs().max() <= bound and p.abs().max() > 0.9 * bound, name
        else:  # normal(0, std): sample std and mean within 4 standard errors (n >= 64 draws per parameter)
            n = p.numel()
            assert abs(p.std().item() / std - 1) < 4 / math.sqrt(2 * n), name
            assert abs(p.mean().item()) < 4 * std / math.sqrt(n), name


def test_same_seed_same_weights_other_seed_other_weights_and_parameters_differ():
    a, b, c = initialized_model(ARGS, 0).state_dict(), initialized_model(ARGS, 0).state_dict(), initialized_model(ARGS, 1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.mlp.gate.weight"], c["layers.0.mlp.gate.weight"])
    # Per-parameter generators: two parameters of one shape do not share draws.
    assert not torch.equal(a["layers.0.mlp.gate.weight"], a["layers.1.mlp.gate.weight"])


def test_activation_checkpointing_changes_neither_the_names_nor_the_weights():
    plain = initialized_model(ARGS, 5).state_dict()
    from models.qwen35_moe import Qwen35MoeModel

    with torch.device("meta"):
        model = Qwen35MoeModel(ARGS)
    parallelize_qwen35_moe(model, None, param_dtype=None, reduce_dtype=None, ac_mode="full", compile=False)
    model.to_empty(device="cpu")
    model.init_weights(5)
    checkpointed = model.state_dict()
    assert list(checkpointed) == list(plain) and [n for n, _ in model.named_parameters()] == [
        n for n, _ in initialized_model(ARGS, 5).named_parameters()]
    assert all(torch.equal(checkpointed[k], v) for k, v in plain.items())
