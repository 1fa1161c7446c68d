"""The MoE layer's token dispatch and combine: against a per-token reference (each token through its k experts,
weighted, plus the shared expert; float64), and `gather_rows`' gather-only backward against autograd's own
indexing backward and against a once-rounded sum in bf16."""

import torch
import torch.nn.functional as F

from models.qwen35_moe import Qwen35MoeArgs
from models.qwen35_moe.moe import SparseMoE, gather_rows, inverse_permutation

ARGS = Qwen35MoeArgs(hidden_size=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=8,
                     shared_expert_intermediate_size=12)


def per_token_reference(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Each token on its own: softmax router, top-k renormalised, its experts' SwiGLU outputs weighted and
    summed, plus the sigmoid-gated shared expert (the definition, with no sorting or batching)."""
    rows = []
    for token in x:
        probs = F.linear(token, moe.gate.weight).softmax(-1)
        weights, ids = probs.topk(moe.top_k)
        weights = weights / weights.sum()
        gate, up = moe.experts.gate_up_proj.split(ARGS.moe_intermediate_size, dim=1)  # (E, I, D) each
        out = sum(w * F.linear(F.silu(F.linear(token, gate[e])) * F.linear(token, up[e]), moe.experts.down_proj[e])
                  for w, e in zip(weights, ids.tolist()))
        shared = moe.shared_expert(token[None])[0]
        rows.append(out + torch.sigmoid(moe.shared_expert_gate(token)) * shared)
    return torch.stack(rows)


def test_moe_layer_matches_per_token_reference_with_gradients():
    torch.manual_seed(0)
    moe = SparseMoE(ARGS).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
        moe.gate.weight[6:, 0] = -5.0  # with x[..., 0] = 3: experts 6 and 7 get no token
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    x[..., 0] = 3.0
    x.requires_grad_()
    out, counts, _ = moe(x)
    assert (counts == 0).any()
    ref_x = x.detach().clone().requires_grad_()
    ref = per_token_reference(moe, ref_x.reshape(-1, 16)).reshape(x.shape)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)

    grad_out = torch.randn_like(out)
    ours = torch.autograd.grad(out, [x, *moe.parameters()], grad_out)
    theirs = torch.autograd.grad(ref, [ref_x, *moe.parameters()], grad_out, allow_unused=True)
    for name, a, b in zip(["x", *(n for n, _ in moe.named_parameters())], ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


def test_gather_rows_gradient_equals_indexing_gradient():
    torch.manual_seed(1)
    k, n = 4, 9
    perm = torch.randperm(n * k)
    inverse = inverse_permutation(perm)
    assert torch.equal(perm[inverse], torch.arange(n * k))
    for x, index, group in ((torch.randn(n, 5, dtype=torch.float64), perm // k, k),  # each row taken k times
                            (torch.randn(n * k, 5, dtype=torch.float64), perm, 1)):  # a permutation
        x.requires_grad_()
        grad = torch.randn(len(index), 5, dtype=torch.float64)
        ours = torch.autograd.grad(gather_rows(x, index, inverse, group), x, grad)[0]
        theirs = torch.autograd.grad(x[index], x, grad)[0]
        torch.testing.assert_close(ours, theirs, rtol=1e-15, atol=1e-15)


def test_gather_rows_bf16_gradient_is_rounded_once():
    # Each row's gradient is its k output rows summed exactly, then rounded to bf16 once; scatter-add rounds at
    # every add (and on CUDA in no fixed order).
    torch.manual_seed(2)
    k, n = 8, 64
    perm = torch.randperm(n * k)
    x = torch.randn(n, 32, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(n * k, 32, dtype=torch.bfloat16)
    ours = torch.autograd.grad(gather_rows(x, perm // k, inverse_permutation(perm), k), x, grad)[0]
    exact = grad.double().index_select(0, inverse_permutation(perm)).view(n, k, 32).sum(1)
    torch.testing.assert_close(ours, exact.to(torch.bfloat16), rtol=0, atol=0)


def test_auto_dispatch_takes_the_all_gather_while_it_moves_at_most_half_the_all_to_alls_bytes():
    from parallel.expert_parallel import resolve_dispatch
    # 35B-A3B routes top-8: EP=2 and 4 all-gather (measured faster on H200s), EP=8 and up all-to-all
    assert [resolve_dispatch("auto", ep, 8) for ep in (1, 2, 4, 8, 16)] == \
        ["all_gather", "all_gather", "all_gather", "all_to_all", "all_to_all"]
    assert resolve_dispatch("auto", 2, 2) == "all_to_all"  # the debug model's top-2
    assert resolve_dispatch("all_gather", 16, 8) == "all_gather"  # an explicit choice stands
