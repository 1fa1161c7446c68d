"""What the project relies on inside torch (parallel/torch_internals.py): each test fails when a torch release
changes the behaviour, not only the name, the project depends on."""

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from parallel.torch_internals import (
    FUNCTIONAL_COLLECTIVES,
    flatten_mesh,
    function_with_own_frames,
    functional_collective_ops,
    graph_break_error,
    ignore_profiler_ranges_in_selective_checkpointing,
    inside_backward,
    own_parameters,
    run_when_backward_ends,
    set_last_lr,
    version_counters,
)


def _block(x: torch.Tensor, break_graph: bool) -> torch.Tensor:
    y = x.sin()
    if break_graph:
        torch._dynamo.graph_break()
    return y.cos()


def test_a_function_with_copied_code_gets_compiled_frames_of_its_own():
    """Dynamo caches frames per code object: the copy and the original, called alike, compile separately, so the
    original's callers never run the copy's frames (the first block's, with its graph break under FSDP)."""
    torch._dynamo.reset()
    counter = CompileCounter()
    original = torch.compile(_block, backend=counter)
    copy = torch.compile(function_with_own_frames(_block, "_first_block"), backend=counter)
    x = torch.randn(4)
    copy(x, True)
    assert counter.frame_count == 2  # the graph break splits it in two frames
    copy(x, True)
    assert counter.frame_count == 2  # cached
    original(x, True)
    assert counter.frame_count == 4  # the same code's frames again, the original's own
    torch.testing.assert_close(copy(x, True), _block(x, True))
    torch._dynamo.reset()


def _recompute_opens_a_profiler_range():
    """A selectively checkpointed function that opens a profiler range in its recompute only, as FSDP2's hooks of a
    nested unit do; returns its input's gradient."""
    calls = []

    def fn(x):
        calls.append(1)
        if len(calls) > 1:  # the recompute
            with torch.profiler.record_function("hook"):
                pass
        return (x.sin() * 2).sum()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op is torch.ops.aten.sin.default else CheckpointPolicy.PREFER_RECOMPUTE

    x = torch.randn(8, requires_grad=True)
    checkpoint(fn, x, use_reentrant=False,
               context_fn=lambda: create_selective_checkpoint_contexts(policy)).backward()
    return x.grad


def test_selective_checkpointing_refuses_unmatched_profiler_ranges_unless_ignored(monkeypatch):
    from torch.utils import checkpoint as checkpoint_module

    # torch's own set, without the profiler ops an earlier test of this process may have added
    profiler_ops = {op for op in checkpoint_module.SAC_IGNORED_OPS if "profiler" in str(op)}
    monkeypatch.setattr(checkpoint_module, "SAC_IGNORED_OPS", set(checkpoint_module.SAC_IGNORED_OPS) - profiler_ops)
    if torch.torch_version.TorchVersion(torch.__version__) >= "2.13":  # matches the recompute's ops with the forward's
        with pytest.raises(RuntimeError, match="not found in storage"):
            _recompute_opens_a_profiler_range()
    else:  # torch 2.11 and 2.12 (each run): an op the policy recomputes is not matched, so the range passes
        assert torch.isfinite(_recompute_opens_a_profiler_range()).all()
    ignore_profiler_ranges_in_selective_checkpointing()
    x_grad = _recompute_opens_a_profiler_range()
    assert x_grad is not None and torch.isfinite(x_grad).all()


class _DispatchedOps(TorchDispatchMode):
    """Records every op dispatched below autograd, as selective checkpointing's policy sees them."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_the_exchanges_dispatch_the_collective_ops_selective_checkpointing_keeps(one_rank_mesh):
    """Each exchange of parallel/collectives.py, and expert parallelism's count exchange, dispatches one of
    `functional_collective_ops`: selective checkpointing keeps their outputs instead of running them again."""
    from parallel.collectives import all_gather, all_to_all, reduce_scatter_sum
    from parallel.expert_parallel import exchange_counts

    kept = functional_collective_ops()
    assert len(kept) == len(FUNCTIONAL_COLLECTIVES)
    group = one_rank_mesh.get_group()
    x = torch.randn(4, 3, requires_grad=True)
    exchanges = {"all_gather": lambda: all_gather(x, group), "reduce_scatter_sum": lambda: reduce_scatter_sum(x, group),
                 "all_to_all": lambda: all_to_all(x, [4], [4], group),
                 "exchange_counts": lambda: exchange_counts(torch.arange(4), group)}
    for name, exchange in exchanges.items():
        with _DispatchedOps() as dispatched:
            exchange().sum().item()  # waited for
        assert kept & set(dispatched.ops), (name, dispatched.ops)


def test_a_fullgraph_compile_that_breaks_the_graph_raises_before_running_anything():
    """The compiled MoE half (fullgraph) that meets a graph break (here a `torch.compiler.disable`d call, as the CPU
    experts' loop) raises `graph_break_error()` at its first call, before any of it ran: it can then run eagerly."""
    ran = []

    @torch.compiler.disable
    def host_loop(x):
        return x * 2

    def half(x):
        ran.append("half")
        return host_loop(x.sin()).cos()

    torch._dynamo.reset()
    with pytest.raises(graph_break_error()):
        torch.compile(half, fullgraph=True)(torch.randn(4))
    assert ran == []
    torch._dynamo.reset()


def test_a_callback_queued_during_a_backward_runs_once_the_whole_backward_has_finished():
    """The replicated parameters' gradients are averaged by one callback queued from the first gradient hook: it must
    run after every gradient of the backward is in place, once, before `backward()` returns."""
    early, late = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    seen = []

    def queue(param):  # `early`'s gradient is accumulated first: its path is the shortest
        seen.append(("hook", late.grad is None))
        run_when_backward_ends(lambda: seen.append(("callback", late.grad is not None)))

    early.register_post_accumulate_grad_hook(queue)
    (late.sin().exp().cos().sum() + early.sum()).backward()
    assert seen == [("hook", True), ("callback", True)]


def test_inside_backward_tells_a_checkpoint_recompute_from_the_forward():
    """Expert parallelism's exchange reuses the forward's split sizes in a recompute: the check must be false in a
    forward (also a checkpointed one) and true in the recompute that the backward runs."""
    seen = []

    def layer(x):
        seen.append(inside_backward())
        return x.sin()

    x = torch.randn(4, requires_grad=True)
    assert not inside_backward()
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert seen == [False, True]


def test_a_modules_own_parameter_dict_holds_its_current_parameters():
    """one_device_precision.py and replicated_params.py keep this dict and read a module's parameters from it at
    every forward: it must stay the module's, and follow `to_empty()`, `.to()` and assignments."""
    with torch.device("meta"):
        linear = torch.nn.Linear(4, 3)
    parameters = own_parameters(linear)
    linear.to_empty(device="cpu")  # new parameter objects
    assert parameters["weight"] is linear.weight and parameters["weight"].device.type == "cpu"
    linear.to(torch.float64)
    assert parameters["weight"] is linear.weight and parameters["weight"].dtype == torch.float64
    linear.weight = torch.nn.Parameter(torch.zeros(3, 4))
    assert parameters["weight"] is linear.weight
    linear.load_state_dict({"weight": torch.ones(3, 4), "bias": torch.ones(3)}, assign=True)
    assert parameters["bias"] is linear.bias and own_parameters(linear) is parameters
    assert set(parameters) == {name for name, _ in linear.named_parameters()}


def test_version_counters_move_with_in_place_changes_through_torch_only():
    """One GPU's weight copies are recast when their weight's counter moved (a load, an init, torch's optimizers),
    and not after FastAdam's kernel, which writes through a raw pointer as numpy does here (and rewrites the copy)."""
    linear = torch.nn.Linear(4, 3, bias=False)
    weight = linear.weight
    before = version_counters([weight])[0]
    writes = [lambda: linear.load_state_dict({"weight": torch.ones(3, 4)}),
              lambda: torch.nn.init.normal_(weight),
              lambda: torch.optim.SGD([weight], lr=0.1).step()]
    weight.grad = torch.ones_like(weight)
    for write in writes:
        write()
        after = version_counters([weight])[0]
        assert after > before
        before = after
    weight.detach().numpy()[:] = 5.0  # the same memory, written outside torch's ops
    assert version_counters([weight]) == [before] and bool((weight == 5).all())


def test_flattened_mesh_dimensions_keep_their_ranks_in_order_and_the_root_mesh_slices_them_by_name():
    """parallel_dims.py's meshes under EP and HSDP, on rank 13 of (dp_replicate 2, efsdp 2, dp_shard_in_ep 2, cp 2):
    the FSDP dimension flattens the last three, the EP group the last two of the same world mesh, each over its ranks
    in row-major order, and HSDP's mesh is the world mesh sliced by the flattened name beside dp_replicate."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=13, world_size=16)  # meshes of 16 ranks, no traffic
    try:
        world = init_device_mesh("cpu", (2, 2, 2, 2), mesh_dim_names=("dp_replicate", "efsdp", "dp_shard_in_ep", "cp"))
        fsdp = flatten_mesh(world["efsdp", "dp_shard_in_ep", "cp"], "dp_shard_cp")
        ep = flatten_mesh(world["dp_shard_in_ep", "cp"], "ep")
        assert fsdp.mesh_dim_names == ("dp_shard_cp",) and fsdp.mesh.tolist() == list(range(8, 16))
        assert ep.mesh_dim_names == ("ep",) and ep.mesh.tolist() == [12, 13, 14, 15]
        assert (fsdp.get_local_rank(), ep.get_local_rank()) == (5, 1)
        hsdp = world["dp_replicate", "dp_shard_cp"]
        assert hsdp.mesh_dim_names == ("dp_replicate", "dp_shard_cp")
        assert hsdp.mesh.tolist() == [list(range(8)), list(range(8, 16))]
    finally:
        dist.destroy_process_group()


def test_an_lr_schedulers_last_lr_is_what_set_last_lr_set_until_its_next_step():
    """A relaunch sets the lr in force by hand (harness/optim/relaunch.py): get_last_lr() reports it, and the next
    step() moves on from the schedule as before."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 0.5 ** n)
    optimizer.param_groups[0]["lr"] = 0.25
    set_last_lr(scheduler, [0.25])
    assert scheduler.get_last_lr() == [0.25]
    optimizer.step()
    scheduler.step()
    assert scheduler.get_last_lr() == [0.5] and optimizer.param_groups[0]["lr"] == 0.5
