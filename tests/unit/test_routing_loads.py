"""The routing-load metrics (harness/objective.py `routing_loads`) against counting by hand."""

import pytest
import torch

from harness.objective import routing_loads


def by_hand(counts: list[list[float]], ep: int) -> tuple[float, float]:
    expert_load = rank_load = 0.0
    for layer in counts:
        total, experts = sum(layer), len(layer)
        expert_load = max(expert_load, max(layer) / (total / experts))
        per_rank = experts // ep
        ranks = [sum(layer[r * per_rank:(r + 1) * per_rank]) for r in range(ep)]
        rank_load = max(rank_load, max(ranks) / (total / ep))
    return expert_load, rank_load


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_routing_loads_match_counting_by_hand(ep):
    counts = [[3, 0, 5, 8, 1, 1, 0, 2],   # experts without tokens; ranks 2 and 3 of ep=4 get 2 each
              [0, 0, 0, 0, 10, 2, 2, 2],  # under EP=2 the first rank receives nothing
              [2, 2, 2, 2, 2, 2, 2, 2]]   # balanced: 1 and 1
    expert_load, rank_load = routing_loads(torch.tensor(counts, dtype=torch.float32), ep).tolist()
    want = by_hand(counts, ep)
    assert expert_load == pytest.approx(want[0], rel=1e-6)
    assert rank_load == pytest.approx(want[1], rel=1e-6)
    if ep == 1:
        assert rank_load == 1.0
    assert routing_loads(torch.full((2, 8), 3.0), ep).tolist() == [1.0, 1.0]
