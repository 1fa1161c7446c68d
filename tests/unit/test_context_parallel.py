"""The zigzag layout of context parallelism and the checks on CP degrees, on one process."""

import itertools

import pytest
import torch

from harness.config import ConfigError, load_config
from parallel.context_parallel import _natural_order, shard_zigzag, zigzag_index
from tests.runs import run_requirements_error


@pytest.mark.parametrize("cp, seq_len", list(itertools.product([1, 2, 3, 4, 8], [16, 48, 96, 4096])))
def test_zigzag_shards_round_trip_and_balance_the_causal_work(cp, seq_len):
    if seq_len % (2 * cp):
        with pytest.raises(ValueError, match="divisible by 2 \\* context_parallel_degree"):
            zigzag_index(seq_len, cp, 0)
        return
    rows = torch.arange(3 * seq_len).reshape(3, seq_len)
    shards = [shard_zigzag(rows, cp, r) for r in range(cp)]
    chunk = seq_len // (2 * cp)
    for r, shard in enumerate(shards):  # rank r holds chunks r and 2cp-1-r, in that order
        want = torch.cat((rows[:, r * chunk:(r + 1) * chunk], rows[:, (2 * cp - 1 - r) * chunk:(2 * cp - r) * chunk]), 1)
        assert torch.equal(shard, want)
    gathered = torch.cat(shards, dim=1)  # what an all-gather of the shards gives, rank by rank
    assert torch.equal(gathered[:, _natural_order(seq_len, cp, gathered.device)], rows)
    # Causal attention work (keys at or before each query) is the same on every rank.
    work = [int((zigzag_index(seq_len, cp, r) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1


def _cfg(*argv):
    return load_config(["--training.dataset_source", "jsonl", "--training.dataset_path", __file__, *argv])


@pytest.mark.parametrize("argv, message", [
    (["--parallelism.context_parallel_degree", "3", "--training.seq_len", "96"],
     "must divide the Gated DeltaNet key and value head counts (2 and 4)"),
    (["--parallelism.context_parallel_degree", "2", "--training.seq_len", "102"],
     "training.seq_len = 102 must be divisible by 2 * parallelism.context_parallel_degree = 4"),
])
def test_impossible_context_parallel_layouts_are_named_before_anything_starts(argv, message):
    with pytest.raises(ConfigError) as e:
        run_requirements_error(_cfg(*argv))
    assert message in str(e.value)
    run_requirements_error(_cfg("--parallelism.context_parallel_degree", "2", "--training.seq_len", "96"))


def _bottom_right_varlen(q, k, v, cu_q, cu_k):
    """What a flash varlen kernel computes, written out: per segment, softmax attention causal with the last query
    aligned to the last key. q (Tq, H, D), k/v (Tk, H, D)."""
    out = torch.empty_like(q)
    for i in range(cu_q.numel() - 1):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        lq, lk = qs.stop - qs.start, ks.stop - ks.start
        scores = torch.einsum("qhd,khd->hqk", q[qs], k[ks]) / q.shape[-1] ** 0.5
        allowed = torch.arange(lk) <= torch.arange(lq).unsqueeze(1) + (lk - lq)
        out[qs] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v[ks])
    return out


@pytest.mark.parametrize("cp, starts", [
    (2, [[0], [0]]),  # one document per row
    (2, [[0, 10, 30, 47], [0, 5, 6, 40, 41]]),  # boundaries inside and on chunk edges (chunk = 12)
    (3, [[0, 24, 25], [0, 1, 2, 3, 40]]),  # documents of one token (chunk = 8)
    (4, [[0, 6, 12, 24, 42], [0, 33]]),  # boundaries exactly on chunk edges (chunk = 6)
])
def test_context_parallel_varlen_segments_give_the_masked_attention(cp, starts):
    """The (chunk, document) segments the CUDA path feeds flash varlen reproduce the mask path exactly."""
    from models.qwen35_moe.attention import _sdpa_context_parallel
    from models.qwen35_moe.documents import context_parallel_layout, context_parallel_segments

    seq, heads, dim = 48, 2, 8
    position_ids = torch.zeros(len(starts), seq, dtype=torch.long)
    for b, row_starts in enumerate(starts):
        for s, e in zip(row_starts, row_starts[1:] + [seq]):
            position_ids[b, s:e] = torch.arange(e - s)
    position_ids[1, :(starts[1] + [seq])[1]] += 3  # row 1 opens with the rest of a document from the row before
    torch.manual_seed(0)
    k, v = torch.randn(2, len(starts) * seq, heads, dim, dtype=torch.float64)
    for rank in range(cp):
        index = zigzag_index(seq, cp, rank)
        layout = context_parallel_layout(position_ids[:, index], position_ids, index)
        seg = context_parallel_segments(layout)
        q = torch.randn(len(starts), index.numel(), heads, dim, dtype=torch.float64)
        got = _bottom_right_varlen(q.flatten(0, 1), k[seg.key_index], v[seg.key_index], seg.cu_seqlens_q,
                                   seg.cu_seqlens_k).view_as(q)
        whole_k, whole_v = (t.view(len(starts), seq, heads, dim).transpose(1, 2) for t in (k, v))
        want = _sdpa_context_parallel(q.transpose(1, 2), whole_k, whole_v, layout).transpose(1, 2)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        lengths_q = seg.cu_seqlens_q.diff()
        assert int(lengths_q.sum()) == q.shape[0] * q.shape[1] and int(lengths_q.min()) > 0
        assert seg.max_seqlen_q == int(lengths_q.max()) and seg.max_seqlen_k == int(seg.cu_seqlens_k.diff().max())
