"""Expert parallelism's exchange on CUDA (NCCL, one rank, bf16 grouped GEMM experts): the layer gives the plain
layer's output and gradients bitwise (one rank: the exchange only permutes), and the host waits for the GPU once
per layer, for the split sizes, nowhere else (the other ranks' layouts run on CPU in tests/distributed/test_fsdp.py
and on GPUs in benchmarks/train_throughput.py)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from models.qwen35_moe import Qwen35MoeArgs
from models.qwen35_moe.moe import SparseMoE
from parallel.expert_parallel import ExpertParallel, shard_experts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ARGS = Qwen35MoeArgs(hidden_size=256, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                     shared_expert_intermediate_size=128)


@pytest.fixture
def nccl_mesh():
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    yield init_device_mesh("cuda", (1,))
    dist.destroy_process_group()


def _run(layer, x, probe):
    x = x.clone().requires_grad_()
    out = layer(x)[0]
    (out.float() * probe).sum().backward()
    grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad) for n, p in layer.named_parameters()}
    return out.detach(), x.grad, grads


def test_one_rank_exchange_gives_the_plain_layer_bitwise_and_syncs_only_for_the_split_sizes(nccl_mesh):
    torch.manual_seed(0)
    plain = SparseMoE(ARGS)
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(0, 0.05)
        plain.gate.weight.normal_(0, 0.5)  # decisive routing, some experts busier than others
    plain = plain.to("cuda", torch.bfloat16)
    ep = copy.deepcopy(plain)
    shard_experts(ep.experts, nccl_mesh)
    ep._ep = ExpertParallel(nccl_mesh)
    x = torch.randn(2, 300, ARGS.hidden_size, device="cuda", dtype=torch.bfloat16)
    probe = torch.randn(2, 300, ARGS.hidden_size, device="cuda")

    want = _run(plain, x, probe)
    _run(ep, x, probe)  # warm-up: NCCL's communicator, pinned host memory
    for p in ep.parameters():
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _run(ep, x, probe)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)]
    assert len(syncs) == 1 and "expert_parallel.py" in syncs[0], syncs  # the split sizes' copy to the host

    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])
    for name, grad in want[2].items():
        assert torch.equal(got[2][name], grad), name
