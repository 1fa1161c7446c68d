"""The run lock on 2 gloo ranks (harness/run_lock.py): rank 0 decides, every rank learns its verdict."""

import json
import os

from tests.distributed.launch import Run, register

VERDICT = register(Run("run_lock/verdict", 2, "tests.distributed.run_lock_worker:verdict"))


def test_every_rank_is_refused_with_rank_0s_message_and_only_rank_0_holds_the_lock(launches):
    folder = launches.folder_of(VERDICT)
    ranks = [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]
    refusal = f"{folder / 'dump'} is in use by the run on host "
    assert ranks[0]["refused"] == ranks[1]["refused"] and ranks[0]["refused"].startswith(refusal)
    assert "wait for it, stop it, or choose another job.dump_folder" in ranks[0]["refused"]
    assert (ranks[0]["held"], ranks[1]["held"]) == (True, False)
    assert sorted(os.listdir(folder / "dump")) == [".lock"]
