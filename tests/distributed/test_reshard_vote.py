"""`fsdp_reshard_after_forward = "auto"` over 2 gloo ranks: where the gathered weights fit on one rank only, no rank
keeps them (a unit keeps its weights on all of its ranks or on none)."""

import json

from tests.distributed.launch import Run, register

VOTE = register(Run("reshard_vote/vote", 2, "tests.distributed.reshard_vote_worker:vote"))


def test_every_rank_keeps_or_none_does(launches):
    folder = launches.folder_of(VOTE)
    assert [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)] == [[False, True]] * 2
