"""Expert parallelism's dispatches (all-to-all, all-gather) on 2 and 4 gloo ranks against the whole MoE layer in one
process (tests/distributed/expert_parallel_worker.py): outputs, input gradients, router, shared-expert and
local-expert gradients in float64, with a rank whose tokens never reach the other ranks' experts."""

import pytest

from tests.distributed.launch import REPO, run, torchrun


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_exchange_equals_the_whole_layer(ep, tmp_path):
    # Inductor compiles in the worker's own process (the compiled case): one CI run under load aborted a rank with
    # "terminate called without an active exception"; inductor's pool of compile workers is a suspect, not proven.
    run([*torchrun(ep), str(REPO / "tests" / "distributed" / "expert_parallel_worker.py")], tmp_path, timeout=300,
        TORCHINDUCTOR_COMPILE_THREADS="1")
