"""Context-parallel attention's CUDA kernel (flash varlen over (chunk, document) segments, bottom-right causal)
against the masked attention computed in float64 on the CPU, for every CP rank's share of packed rows.

The bf16 error is judged against the error of the same masked attention run through SDPA in bf16 on the GPU:
a wrong segment or a top-left-aligned causal mask puts whole rows of output off by O(1), far above that level.
"""

from __future__ import annotations

import pytest
import torch

from models.qwen35_moe.attention import _flash_applies, _flash_varlen_context_parallel, _sdpa_context_parallel
from models.qwen35_moe.documents import context_parallel_layout
from parallel.context_parallel import zigzag_index

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SEQ, CP = 1024, 2
# Documents that start inside chunks and exactly on a chunk edge (chunk = 256); row 1 opens mid-document.
STARTS = [[0, 100, 256, 600, 900], [0, 300, 301, 767]]


def _positions() -> torch.Tensor:
    positions = torch.zeros(len(STARTS), SEQ, dtype=torch.long)
    for b, starts in enumerate(STARTS):
        for s, e in zip(starts, starts[1:] + [SEQ]):
            positions[b, s:e] = torch.arange(e - s)
    positions[1, :STARTS[1][1]] += 7
    return positions


def _rel(a, b) -> float:
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


def _run(fn, q, k, v, layout, grad_out):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, layout)
    out.backward(grad_out.to(out.dtype))
    return [out.detach(), q.grad, k.grad, v.grad]


def _masked(q, k, v, layout):  # (B, S_local, H, D) layout, as the flash path takes them
    return _sdpa_context_parallel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), layout).transpose(1, 2)


@pytest.mark.parametrize("rank", range(CP))
def test_flash_context_parallel_attention_matches_the_masked_reference(rank):
    torch.manual_seed(rank)
    batch, heads, kv_heads, dim = len(STARTS), 4, 2, 256  # 35B-A3B's head_dim and KV head count
    positions, index = _positions(), zigzag_index(SEQ, CP, rank)
    q = torch.randn(batch, index.numel(), heads, dim, dtype=torch.float64)
    k, v = torch.randn(2, batch, SEQ, kv_heads, dim, dtype=torch.float64)
    grad_out = torch.randn_like(q)

    def layout_on(device):
        return context_parallel_layout(positions[:, index].to(device), positions.to(device), index.to(device))

    ref = _run(_masked, q, k, v, layout_on("cpu"), grad_out)
    gpu = [t.to("cuda", torch.bfloat16) for t in (q, k, v)]
    assert _flash_applies(gpu[0])
    flash = _run(_flash_varlen_context_parallel, *gpu, layout_on("cuda"), grad_out.cuda())
    sdpa_bf16 = _run(_masked, *gpu, layout_on("cuda"), grad_out.cuda())
    for name, f, s, r in zip(["out", "dq", "dk", "dv"], flash, sdpa_bf16, ref):
        level = _rel(s, r)
        assert _rel(f, r) < 2 * level, f"{name}: flash {_rel(f, r):.2e} vs bf16 SDPA {level:.2e}"
