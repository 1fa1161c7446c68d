"""checkpoint.initial_load_hf on 2 gloo ranks: rank 0 reads the HF checkpoint one tensor at a time (per-expert
weights fused one tensor at a time) and scatters it; every rank ends with exactly the checkpoint's weights, for
the text-only fused layout and the multimodal per-expert one, also into experts split over the ranks (EP=2)."""

import pytest
import torch

from tests.distributed.hf_load_worker import source_model
from tests.distributed.launch import Run, register

WORKER = "tests.distributed.hf_load_worker:load"
RUNS = {  # checkpoint layout, config overrides
    "text_fused": register(Run("hf_load/text_fused", 2, WORKER, ("text_fused",))),
    "multimodal_per_expert": register(Run("hf_load/multimodal_per_expert", 2, WORKER, ("multimodal_per_expert",))),
    "multimodal_per_expert_ep2": register(Run("hf_load/multimodal_per_expert_ep2", 2, WORKER,
                                              ("multimodal_per_expert", "--parallelism.expert_parallel_degree", "2"))),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_two_ranks_load_exactly_the_checkpoints_weights(launches, name):
    saved, want = torch.load(launches.folder_of(RUNS[name]) / "result.pt"), source_model().state_dict()
    loaded = saved["weights"]
    assert loaded.keys() == want.keys()
    assert saved["replica_spread"] == 0.0  # the parameters whole on every rank, the same on each (rank 1 too)
    for key, value in want.items():
        assert torch.equal(loaded[key], value), key
