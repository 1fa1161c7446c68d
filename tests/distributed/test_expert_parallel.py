"""Expert parallelism's dispatches (all-to-all, all-gather) on 2 and 4 gloo ranks against the whole MoE layer in one
process (tests/distributed/expert_parallel_worker.py): outputs, input gradients, router, shared-expert and
local-expert gradients in float64, with a rank whose tokens never reach the other ranks' experts."""

import pytest

from tests.distributed.launch import Run, register

RUNS = {ep: register(Run(f"expert_parallel/ep{ep}", ep, "tests.distributed.expert_parallel_worker:check"))
        for ep in (2, 4)}


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_exchange_equals_the_whole_layer(launches, ep):
    launches.folder_of(RUNS[ep])  # the worker raises on any difference beyond float64 summation order
