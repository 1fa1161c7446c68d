"""The ranks' vote on stopping (harness/preemption.py) over 2 gloo ranks: agreed one step boundary late, the same
on every rank, and never waiting at a boundary for the other rank to arrive."""

import json

from harness.preemption import INTERRUPTED, TERMINATED
from tests.distributed.launch import Run, register

VOTE = register(Run("stop_vote/vote", 2, "tests.distributed.stop_vote_worker:vote"))


def test_ranks_agree_one_boundary_late_without_waiting_for_each_other(launches):
    folder = launches.folder_of(VOTE)
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]
    # boundary 1 and 2 return the votes before any signal; 3 rank 1's SIGTERM (cast at 2); 4 and the settled vote
    # the larger of rank 0's Ctrl-C and rank 1's SIGTERM; a second settle has nothing in flight
    assert ranks[0] == ranks[1] == [0, 0, TERMINATED, INTERRUPTED, INTERRUPTED, 0]
