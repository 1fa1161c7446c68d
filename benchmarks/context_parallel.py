"""Context parallelism on 2 GPUs: bf16 correctness of CP=2 against CP=1, and the Gated DeltaNet layer's time and
bytes moved under our head-parallel CP against FLA's own context parallel.

    torchrun --nproc-per-node 2 benchmarks/context_parallel.py check [--seq 8192]
    torchrun --nproc-per-node 2 benchmarks/context_parallel.py layer [--seq 32768]

`check`: one packed batch (documents starting inside the zigzag chunks and across their edges) through the
4-layer 35B-A3B-shaped model. The loss and every gradient of CP=1 and CP=2 in bf16 are compared with an fp32
reference (torch kernels on the GPU, same weights): CP=2's error should be CP=1's, which is bf16's own noise.

`layer`: fwd+bwd of one Gated DeltaNet layer of 35B-A3B on one packed row of `seq` tokens: CP=1 (one GPU, all of
it), our CP=2 (all-gather of the input, half the heads per GPU, reduce-scatter after out_proj) and FLA's CP=2
(each GPU its zigzag half of the tokens, all heads; FLA's conv and recurrence exchange states). Prints median
milliseconds over the timed repeats and the bytes each rank sends per layer and step.

Training throughput and the longest trainable sequence come from benchmarks/train_throughput.py and
benchmarks/composed_mesh.py (docs/performance.md, "Context parallelism").
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_model import bench_args, cuda_median_ms  # noqa: E402

import models.qwen35_moe.gated_deltanet as gdn_module  # noqa: E402
from models.qwen35_moe import Qwen35MoeModel  # noqa: E402
from models.qwen35_moe.documents import document_layout  # noqa: E402
from models.qwen35_moe.gated_deltanet import CPAwareGatedDeltaNet  # noqa: E402
from models.qwen35_moe.hooks import ParallelHooks  # noqa: E402
from models.qwen35_moe.kernels.causal_conv import torch_causal_conv1d  # noqa: E402
from models.qwen35_moe.kernels.fla_hopper_guard import enable_fla_hopper_backward  # noqa: E402
from models.qwen35_moe.kernels.gated_delta_rule import torch_chunk_gated_delta_rule  # noqa: E402
from parallel.context_parallel import CPContext, shard_zigzag  # noqa: E402


def packed_positions(seq: int, cp: int) -> torch.Tensor:
    """(1, seq) positions of documents starting inside the 2*cp zigzag chunks and on a chunk edge."""
    chunk = seq // (2 * cp)
    starts = sorted({0, chunk // 3, chunk, 2 * chunk + 17, 3 * chunk - 1, seq - chunk // 2})
    positions = torch.zeros(seq, dtype=torch.long)
    for s, e in zip(starts, starts[1:] + [seq]):
        positions[s:e] = torch.arange(e - s)
    return positions.unsqueeze(0)


def report(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def loss_and_grads(model, ids, positions, labels, n_labels, cp_group=None) -> tuple[float, torch.Tensor]:
    """Summed token cross entropy over the global label count, and the full gradient as one fp32 vector (summed
    over the CP ranks, whose shares of it add up)."""
    model.zero_grad(set_to_none=True)
    loss = model(ids, positions, labels=labels).ce_sum / n_labels  # chunked, as the trainer computes it
    loss.backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    loss = loss.detach()
    if cp_group is not None:
        dist.all_reduce(grads, group=cp_group)
        dist.all_reduce(loss, group=cp_group)
    return loss.item(), grads


def check(ns) -> None:
    rank, cp = dist.get_rank(), dist.get_world_size()
    args = bench_args(4, ns.experts, ns.flavor)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a quick check of this script (gloo)
    torch.manual_seed(0)
    with torch.device("meta"):
        ref = Qwen35MoeModel(args)
    ref.to_empty(device=device)
    ref.init_weights(0)
    with torch.no_grad():  # bf16-representable weights, so every variant starts equal
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (1, ns.seq), generator=g).to(device)
    labels = torch.randint(0, args.vocab_size, (1, ns.seq), generator=g).to(device)
    positions = packed_positions(ns.seq, cp).to(device)

    # fp32 reference with the torch kernels (no FLA fp32 compile); the same on every rank.
    fla_rule, conv_kernel = gdn_module.gated_delta_rule, gdn_module.causal_conv1d_qkv
    gdn_module.gated_delta_rule = lambda q, k, v, g, beta, cu=None, cu_cpu=None: torch_chunk_gated_delta_rule(
        q, k, v, g, beta, cu_seqlens=cu)
    gdn_module.causal_conv1d_qkv = lambda x, w, parts, pos, cu=None: torch_causal_conv1d(x, w, cu).split(parts, -1)
    ref_loss, ref_grads = loss_and_grads(ref, ids, positions, labels, ns.seq)
    gdn_module.gated_delta_rule, gdn_module.causal_conv1d_qkv = fla_rule, conv_kernel
    ref_grads = ref_grads.cpu()

    bf16 = copy.deepcopy(ref).to(torch.bfloat16)
    del ref
    if device == "cuda":
        enable_fla_hopper_backward(args.linear_num_key_heads, args.linear_num_value_heads,
                                   args.linear_key_head_dim, args.linear_value_head_dim, device)
        enable_fla_hopper_backward(args.linear_num_key_heads // cp, args.linear_num_value_heads // cp,
                                   args.linear_key_head_dim, args.linear_value_head_dim, device)
    cp1_loss, cp1_grads = loss_and_grads(bf16, ids, positions, labels, ns.seq)
    cp1_grads = cp1_grads.cpu()

    mesh = init_device_mesh(device, (cp,), mesh_dim_names=("cp",))
    bf16.set_parallel_hooks(ParallelHooks(context_parallel=CPContext(mesh)))
    shard = lambda t: shard_zigzag(t, cp, rank)  # noqa: E731
    cp2_loss, cp2_grads = loss_and_grads(bf16, shard(ids), shard(positions), shard(labels), ns.seq, mesh.get_group())
    cp2_grads = cp2_grads.cpu()

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    names = [n for n, _ in bf16.named_parameters()]
    sizes = [p.numel() for p in bf16.parameters()]
    def worst(grads):  # the parameter furthest from the reference (those with a gradient at all)
        return max((rel(a, r), n) for n, a, r in zip(names, grads.split(sizes), ref_grads.split(sizes))
                   if r.norm() > 0)

    worst1, worst = worst(cp1_grads), worst(cp2_grads)
    report(f"check: seq {ns.seq}, 4 layers of {ns.flavor}, {ns.experts} experts, one packed row, cp {cp}")
    report(f"check: loss fp32 {ref_loss:.6f}  bf16 CP=1 {cp1_loss:.6f} (|d| {abs(cp1_loss - ref_loss):.2e})  "
           f"bf16 CP={cp} {cp2_loss:.6f} (|d| {abs(cp2_loss - ref_loss):.2e})")
    report(f"check: gradient rel error vs fp32: CP=1 {rel(cp1_grads, ref_grads):.3e}  CP={cp} "
           f"{rel(cp2_grads, ref_grads):.3e}  (CP={cp} vs CP=1: {rel(cp2_grads, cp1_grads):.3e})")
    report(f"check: worst parameter vs fp32: CP=1 {worst1[0]:.3e} ({worst1[1]})  CP={cp} {worst[0]:.3e} ({worst[1]})")
    ok = rel(cp2_grads, ref_grads) < 1.5 * rel(cp1_grads, ref_grads) and worst[0] < 1.5 * worst1[0] + 1e-3
    report(f"check: {'PASS' if ok else 'FAIL'} (CP={cp} error within 1.5x of bf16's own)")


class FlaContextParallelGDN(CPAwareGatedDeltaNet):
    """The same layer run the way FLA's own context parallel splits it: each rank its zigzag tokens, all heads;
    the causal conv and the recurrence pass boundary states between ranks (fla.ops.cp)."""

    def forward_fla_cp(self, x, cp_context):
        from fla.modules.causal_conv1d import causal_conv1d as fla_conv
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        tokens = x.shape[:2]
        cu = cp_context.cu_seqlens
        qkv, _ = fla_conv(F.linear(x, self.in_proj_qkv.weight), self.conv1d.weight.squeeze(1), activation="silu",
                          cu_seqlens=cu, cp_context=cp_context)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(*tokens, self.num_k_heads, self.head_k_dim)
        k = k.reshape(*tokens, self.num_k_heads, self.head_k_dim)
        v = v.reshape(*tokens, self.num_v_heads, self.head_v_dim)
        beta = F.linear(x, self.in_proj_b.weight).sigmoid()
        g = self._fp32_params(F.linear(x, self.in_proj_a.weight))
        o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                      cp_context=cp_context)
        z = F.linear(x, self.in_proj_z.weight).reshape(*tokens, self.num_v_heads, self.head_v_dim)
        o = self.norm(o.to(v.dtype), z).reshape(*tokens, self.value_dim)
        return F.linear(o, self.out_proj.weight)


def timed(fn, repeats: int) -> float:
    """Median milliseconds of fn() (forward + backward), the ranks starting each call together."""
    return cuda_median_ms(fn, repeats, before=dist.barrier)


def layer(ns) -> None:
    from fla.ops.cp import build_cp_context

    rank, cp = dist.get_rank(), dist.get_world_size()
    args = bench_args(4, 8)
    torch.manual_seed(0)
    gdn = FlaContextParallelGDN(args).cuda()
    for p in gdn.parameters():
        torch.nn.init.normal_(p, std=0.02)
    with torch.no_grad():
        gdn._fp32_params.A_log.uniform_(0, 2.7)
        gdn._fp32_params.dt_bias.fill_(0.5)
        gdn.norm.weight.fill_(1.0)
    gdn.to(torch.bfloat16)
    positions = packed_positions(ns.seq, cp).cuda()
    whole = document_layout(positions, 1, ns.seq, positions.device)
    x = torch.randn(1, ns.seq, args.hidden_size, device="cuda", dtype=torch.bfloat16) * 0.5
    dy = torch.randn_like(x)
    enable_fla_hopper_backward(args.linear_num_key_heads, args.linear_num_value_heads,
                               args.linear_key_head_dim, args.linear_value_head_dim, "cuda")
    enable_fla_hopper_backward(args.linear_num_key_heads // cp, args.linear_num_value_heads // cp,
                               args.linear_key_head_dim, args.linear_value_head_dim, "cuda")

    def step(fn, inp, grad):
        inp = inp.detach().requires_grad_()
        fn(inp).backward(grad)
        return inp.grad

    # CP=1: each GPU runs the whole row (the ranks run the same thing at the same time).
    ms_cp1 = timed(lambda: step(lambda t: gdn(t, whole), x, dy), ns.repeats)
    report(f"layer: CP=1 timed ({ms_cp1:.2f} ms)")
    ref_out = gdn(x, whole).detach()

    mesh = init_device_mesh("cuda", (cp,), mesh_dim_names=("cp",))
    context = CPContext(mesh)
    gdn.set_parallel_hooks(ParallelHooks(context_parallel=context))
    layout = context.rows_layout(positions)
    x_local, dy_local = shard_zigzag(x, cp, rank), shard_zigzag(dy, cp, rank)
    ms_ours = timed(lambda: step(lambda t: gdn(t, layout), x_local, dy_local), ns.repeats)
    report(f"layer: ours timed ({ms_ours:.2f} ms)")
    ours_err = ((gdn(x_local, layout).detach() - shard_zigzag(ref_out, cp, rank)).float().norm()
                / shard_zigzag(ref_out, cp, rank).float().norm()).item()

    context = build_cp_context(whole.cu_seqlens.long(), group=mesh.get_group(), conv1d_kernel_size=4,
                               layout="zigzag")
    ms_fla = timed(lambda: step(lambda t: gdn.forward_fla_cp(t, context), x_local, dy_local), ns.repeats)
    fla_err = ((gdn.forward_fla_cp(x_local, context).detach() - shard_zigzag(ref_out, cp, rank)).float().norm()
               / shard_zigzag(ref_out, cp, rank).float().norm()).item()

    # Bytes each rank sends per layer and step (forward + backward), bf16 activations, fp32 states.
    d, s_local = args.hidden_size, ns.seq // cp
    ours_bytes = 2 * (cp - 1) * s_local * d * 2  # fwd: all-gather x + reduce-scatter y; bwd: their mirrors
    state = args.linear_num_value_heads * args.linear_key_head_dim * args.linear_value_head_dim * 4
    conv_tail = (args.linear_conv_kernel_dim - 1) * (2 * args.linear_num_key_heads * args.linear_key_head_dim
                                                     + args.linear_num_value_heads * args.linear_value_head_dim) * 2
    fla_bytes = 2 * 2 * (state + conv_tail)  # about: a state and a conv tail per zigzag part, fwd and bwd
    report(f"layer: one GDN layer of 35B-A3B, fwd+bwd, one packed row of {ns.seq} tokens, median of {ns.repeats}")
    report(f"layer: CP=1 (one GPU, whole row)            {ms_cp1:7.2f} ms")
    report(f"layer: ours CP={cp} (head-parallel)            {ms_ours:7.2f} ms  ({ms_cp1 / ms_ours:.2f}x CP=1)  "
           f"sends {ours_bytes / 2**20:.0f} MiB/rank  output rel err vs CP=1 {ours_err:.1e}")
    report(f"layer: FLA CP={cp} (sequence-parallel states)  {ms_fla:7.2f} ms  ({ms_cp1 / ms_fla:.2f}x CP=1)  "
           f"sends ~{fla_bytes / 2**20:.1f} MiB/rank  output rel err vs CP=1 {fla_err:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["check", "layer"])
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--hang-dump", type=float, default=0, help="seconds after which to dump stacks and exit")
    parser.add_argument("--flavor", default="35B-A3B", help="layer shapes (debugmodel: a quick check on CPU)")
    ns = parser.parse_args()
    if ns.hang_dump:  # print every thread's stack if the run hangs
        import faulthandler
        faulthandler.dump_traceback_later(ns.hang_dump, exit=True)
    ns.seq = ns.seq or {"check": 8192, "layer": 32768}[ns.what]
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        check(ns) if ns.what == "check" else layer(ns)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
