"""The parameter counts read from the args alone (models/qwen35_moe/sizes.py) equal those of the model built from the
same args, and LoRA's adapters' those `add_adapters` gives it: the memory check before a run stands on them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.qwen35_moe import Qwen35MoeModel, get_flavor
from models.qwen35_moe.lora import add_adapters
from models.qwen35_moe.lora_targets import DEFAULT_TARGETS, TARGETS, LoraArgs
from models.qwen35_moe.sizes import adapter_count, parameter_counts


def built(args, lora: LoraArgs | None = None) -> Qwen35MoeModel:
    with torch.device("meta"):
        model = Qwen35MoeModel(args)
        if lora is not None:
            add_adapters(model, lora)
    return model


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_mtp", "35B-A3B", "397B-A17B"])
@pytest.mark.parametrize("tied, bias", [(False, False), (True, True)])
def test_parameter_counts_equal_the_built_models(flavor, tied, bias):
    args = dataclasses.replace(get_flavor(flavor), tie_word_embeddings=tied, attention_bias=bias)
    named = dict(built(args).named_parameters())  # a tied weight is listed once
    counts = parameter_counts(args)
    assert counts.total == sum(p.numel() for p in named.values())
    assert counts.experts == sum(p.numel() for n, p in named.items() if ".experts." in n)
    assert counts.mtp == sum(p.numel() for n, p in named.items() if n.startswith("mtp."))


@pytest.mark.parametrize("flavor", ["debugmodel_mtp", "35B-A3B"])
@pytest.mark.parametrize("targets", [DEFAULT_TARGETS, TARGETS, ("experts",), ("fc", "router", "shared_expert_gate")])
@pytest.mark.parametrize("mtp, expert_rank", [(False, 0), (True, 0), (False, 24)])
def test_adapter_counts_equal_those_add_adapters_gives(flavor, targets, mtp, expert_rank):
    args = get_flavor(flavor)
    lora = LoraArgs(rank=8, alpha=16.0, targets=targets, mtp=mtp, expert_rank=expert_rank)
    assert adapter_count(args, lora) == sum(p.numel() for p in built(args, lora).parameters() if p.requires_grad)
