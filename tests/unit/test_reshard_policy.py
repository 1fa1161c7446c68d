"""`parallelism.fsdp_reshard_after_forward = "auto"` (parallel/reshard_policy.py): after the first step the blocks
keep their gathered weights where the step's peak plus those weights fit in 85% of the GPU's memory, else nothing
changes; on CPU nothing changes. (That keeping changes memory and not the gradients: test_parallelize.py's
"kept later"; that all ranks decide alike: tests/distributed/test_reshard_vote.py.)"""

import copy
from types import SimpleNamespace

import pytest
import torch

import parallel.reshard_policy as policy
from models.qwen35_moe import get_flavor
from parallel.parallelize import apply_fsdp, resharding_units
from tests.builders import initialized_model

GIB = 1024**3


def test_the_weights_fit_up_to_85_percent_of_the_gpu():
    assert policy.all_ranks_fit(60 * GIB, 8 * GIB, 80 * GIB, None)  # 68 GiB = 85%
    assert not policy.all_ranks_fit(60 * GIB, 8 * GIB + 1, 80 * GIB, None)


def _fsdp_model(mesh):
    model = copy.deepcopy(initialized_model(get_flavor("debugmodel")))
    apply_fsdp(model, mesh, None, None)
    return model


@pytest.mark.parametrize("peak_gib, keeps", [(20, True), (70, False)])
def test_on_a_gpu_the_blocks_keep_their_weights_where_they_fit(one_rank_mesh, monkeypatch, peak_gib, keeps):
    model = _fsdp_model(one_rank_mesh)
    units = resharding_units(model)
    measured, kept = [], []
    monkeypatch.setattr(policy, "keep_gathered_weights", kept.append)
    monkeypatch.setattr(policy, "gathered_bytes", lambda units, memory: measured.append(units) or 3 * GIB)
    monkeypatch.setattr(policy, "device_memory", lambda device: SimpleNamespace(peak=lambda: peak_gib * GIB,
                                                                                capacity=lambda: 80 * GIB))
    line = policy.keep_if_it_fits(model, torch.device("cuda", 0), None)
    assert measured == [units]  # the units that free their weights were the ones measured
    assert ("keep their gathered weights" in line) == keeps and f"peak {peak_gib}.0 GiB + 3.0 GiB" in line
    layers = list(model.layers.values())
    assert units == [layers[0].mlp.experts, *layers[:-1]]
    assert kept == ([units] if keeps else [])


def test_on_cpu_nothing_changes(one_rank_mesh):
    model = _fsdp_model(one_rank_mesh)
    assert "on CPU" in policy.keep_if_it_fits(model, torch.device("cpu"), None)
