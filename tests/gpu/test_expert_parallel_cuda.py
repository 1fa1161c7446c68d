"""Expert parallelism's dispatch on CUDA (NCCL, one rank, bf16 grouped GEMM experts): with either dispatch the layer
gives the plain layer's output and gradients bitwise (one rank: the exchange only permutes); the all-to-all makes
the host wait for the GPU once per layer, for the split sizes, the all-gather never. The all-gather's skipped rows
(the other ranks' assignments, which the grouped GEMM leaves unwritten) against a float64 reference. The other
ranks' layouts run on CPU in tests/distributed/test_fsdp.py and on GPUs in benchmarks/train_throughput.py."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from models.qwen35_moe import Qwen35MoeArgs
from models.qwen35_moe.hooks import ParallelHooks
from models.qwen35_moe.moe import RoutedExperts, SparseMoE
from parallel.expert_parallel import AllGatherExpertParallel, ExpertParallel, local_partial_outputs, shard_experts
from parallel.parallelize import DTensorSharding

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


def _plain_layer() -> SparseMoE:
    """The bf16 CUDA layer both tests start from, reproducibly drawn."""
    torch.manual_seed(0)
    plain = SparseMoE(ARGS)
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(0, 0.05)
        plain.gate.weight.normal_(0, 0.5)  # decisive routing, some experts busier than others
    return plain.to("cuda", torch.bfloat16)


def _under_ep(plain: SparseMoE, mesh, dispatch) -> SparseMoE:
    """A copy of `plain` with its experts sharded over `mesh` and exchanged by `dispatch`."""
    ep = copy.deepcopy(plain)
    shard_experts(ep.experts, mesh)
    ep.set_parallel_hooks(ParallelHooks(expert_dispatch=lambda moe: dispatch(mesh), sharding=DTensorSharding()))
    return ep


@pytest.mark.parametrize("dispatch, host_syncs", [(ExpertParallel, 1), (AllGatherExpertParallel, 0)],
                         ids=["all_to_all", "all_gather"])
def test_one_rank_exchange_gives_the_plain_layer_bitwise_and_syncs_only_for_the_split_sizes(nccl_mesh, dispatch,
                                                                                           host_syncs):
    plain = _plain_layer()
    ep = _under_ep(plain, nccl_mesh, dispatch)
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
    assert len(syncs) == host_syncs and all("expert_parallel.py" in s for s in syncs), syncs  # the split sizes

    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])
    for name, grad in want[2].items():
        assert torch.equal(got[2][name], grad), name


@pytest.mark.parametrize("dispatch", [ExpertParallel, AllGatherExpertParallel], ids=["all_to_all", "all_gather"])
def test_one_rank_exchange_compiled_by_inductor_gives_the_eager_layer(nccl_mesh, dispatch):
    """The layer under EP compiled as the trainer compiles it (inductor, NCCL's functional collectives; the
    all-gather dispatch traced into the graph): its output and gradients are the eager layer's up to bf16 rounding
    of the fused kernels."""
    from torch._dynamo.testing import CompileCounterWithBackend

    plain = _plain_layer()
    eager, compiled = _under_ep(plain, nccl_mesh, dispatch), _under_ep(plain, nccl_mesh, dispatch)
    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    compiled.compile(backend=counter)
    x = torch.randn(2, 300, ARGS.hidden_size, device="cuda", dtype=torch.bfloat16)
    probe = torch.randn(2, 300, ARGS.hidden_size, device="cuda")
    want, got = _run(eager, x, probe), _run(compiled, x, probe)
    torch._dynamo.reset()
    # The all-gather dispatch compiles with the layer into one frame, its collective in the graph (measured on an
    # H200); the all-to-all's host-side split sizes break it into 4.
    assert (counter.frame_count == 1) if dispatch is AllGatherExpertParallel else (counter.frame_count > 1)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()
    # Measured on an H200: at most 5.6e-3 (bf16's 8 mantissa bits, rounded in other places by the fused kernels); a
    # wrong exchange is off by O(1).
    assert rel(got[0], want[0]) < 2e-2
    assert rel(got[1], want[1]) < 2e-2
    for name, grad in want[2].items():
        assert rel(got[2][name], grad) < 2e-2, name


def _poison_free_memory() -> None:
    """Fill blocks the caching allocator will hand out again with NaN: unwritten rows of a later buffer then read
    NaN, and an unmasked one shows."""
    blocks = [torch.full((n,), float("nan"), device="cuda") for n in (2 ** p for p in range(8, 24)) for _ in range(4)]
    del blocks


def test_all_gather_partials_skip_the_other_ranks_rows_against_a_float64_reference():
    """Rank 1 of 4 (experts 2-3 of 8): its bf16 partial outputs and the gradients of tokens, routing weights and
    its experts, against the formula in float64, with the unwritten rows of its buffers poisoned with NaN."""
    torch.manual_seed(0)
    tokens, top_k, first, local = 512, 2, 2, 2
    experts = RoutedExperts(local, ARGS.hidden_size, ARGS.moe_intermediate_size)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.05)
    x = torch.randn(tokens, ARGS.hidden_size, dtype=torch.float64)
    weights = torch.rand(tokens, top_k, dtype=torch.float64)
    ids = torch.stack([torch.randperm(ARGS.num_experts)[:top_k] for _ in range(tokens)])
    probe = torch.randn(tokens, ARGS.hidden_size, dtype=torch.float64)

    # float64 reference: for each of this rank's experts, its weight on each token (0 if the token did not pick it)
    ref_x, ref_w = x.clone().requires_grad_(), weights.clone().requires_grad_()
    ref_experts = copy.deepcopy(experts).double()
    ref = torch.zeros(tokens, ARGS.hidden_size, dtype=torch.float64)
    for e in range(local):
        on_token = (ref_w * (ids == first + e)).sum(1, keepdim=True)
        gate, up = (ref_x @ ref_experts.gate_up_proj[e].t()).chunk(2, dim=-1)
        ref = ref + on_token * ((torch.nn.functional.silu(gate) * up) @ ref_experts.down_proj[e].t())
    (ref * probe).sum().backward()

    cuda_experts = copy.deepcopy(experts).to("cuda", torch.bfloat16)
    got_x = x.to("cuda", torch.bfloat16).requires_grad_()
    got_w = weights.to("cuda", torch.float32).requires_grad_()
    _poison_free_memory()
    got = local_partial_outputs(got_x, got_w, ids.cuda(), cuda_experts, first, local)
    (got * probe.cuda()).sum().backward()

    def rel(a, b):
        return ((a.double().cpu() - b).norm() / b.norm()).item()
    # bf16 inputs and weights (8 mantissa bits): relative errors of a few 1e-3 against float64
    assert got.dtype == torch.float32
    assert rel(got, ref.detach()) < 1e-2
    assert rel(got_x.grad, ref_x.grad) < 1e-2
    assert rel(got_w.grad, ref_w.grad) < 1e-2
    for name, p in cuda_experts.named_parameters():
        assert rel(p.grad, dict(ref_experts.named_parameters())[name].grad) < 1e-2, name
