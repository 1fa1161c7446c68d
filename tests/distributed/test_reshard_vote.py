"""`fsdp_reshard_after_forward = "auto"` over 2 gloo ranks: where the gathered weights fit on one rank only, no rank
keeps them (a unit keeps its weights on all of its ranks or on none)."""

import json

from tests.distributed.launch import REPO, launch, torchrun

WORKER = str(REPO / "tests" / "distributed" / "reshard_vote_worker.py")


def test_every_rank_keeps_or_none_does(tmp_path):
    result = launch([*torchrun(2), WORKER, str(tmp_path)], tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)] == [[False, True]] * 2
