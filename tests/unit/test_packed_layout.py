"""Training's document layout is the packed (varlen) one for every batch, also where each row holds one document
(documents.document_layout's `packed`): that layout computes what the plain one does, and a compiled run that
meets such a batch after others does not compile again."""

import pytest
import torch
from torch._dynamo.utils import counters

from models.qwen35_moe import attention, get_flavor
from models.qwen35_moe.documents import document_layout
from tests.builders import compile_blocks, initialized_model
from tests.compiled import (
    BATCH,
    SEQ,
    assert_compiled_matches_eager,
    batch_ids,
    compiled_without_inductor,
    loss_and_grads,
    packed_positions,
    varlen_stand_in,
)


def test_rows_of_one_document_get_cu_seqlens_at_the_rows_starts_when_packed():
    positions = torch.stack([torch.arange(SEQ), torch.arange(7, SEQ + 7)])  # the second continues a document
    plain = document_layout(positions, 2, SEQ, positions.device)
    packed = document_layout(positions, 2, SEQ, positions.device, packed=True)
    assert not plain.is_packed and packed.is_packed
    assert packed.cu_seqlens.tolist() == [0, SEQ, 2 * SEQ] and packed.max_seqlen == SEQ
    assert torch.equal(packed.document_ids, torch.ones(2, SEQ, dtype=packed.document_ids.dtype))
    assert torch.equal(packed.cu_seqlens_cpu, packed.cu_seqlens)  # host positions: the host copy is at hand


def test_the_packed_layout_of_whole_rows_computes_what_the_plain_layout_does():
    """Float64 on CPU: the varlen paths (the gated delta rule's recurrence restarted at each cu_seqlens bound,
    attention under a per-document mask) against the plain ones (the recurrence per batch row, causal SDPA)."""
    model = initialized_model(get_flavor("debugmodel")).double()
    ids = batch_ids(5)
    positions = torch.arange(SEQ).expand(2, SEQ)
    loss, grads = loss_and_grads(model, ids, None)  # no position ids: the plain layout
    layout = document_layout(positions, 2, SEQ, positions.device, packed=True)
    loss_packed, grads_packed = loss_and_grads(model, ids, None, layout=layout)
    assert loss_packed == pytest.approx(loss, rel=1e-12)
    for name, grad in grads.items():  # float64: only summation order differs
        torch.testing.assert_close(grads_packed[name], grad, rtol=1e-9, atol=1e-12, msg=name)


def test_a_compiled_run_meeting_rows_of_one_document_does_not_compile_again(monkeypatch):
    """As training feeds the model (layouts built on the host, packed): after the first packed batch, neither a
    batch with another document count (cu_seqlens' size is marked dynamic: without it, a recompile of every block)
    nor a batch whose rows each hold one document compiles anything. With the plain layout the latter took another
    path through every block: a recompile, and on CUDA FLA's other kernels."""
    monkeypatch.setattr(attention, "_flash_applies", lambda q: True)
    monkeypatch.setattr(attention, "_varlen_attn", lambda: (varlen_stand_in, True))
    torch._dynamo.reset()
    eager = initialized_model(get_flavor("debugmodel"))
    compiled = initialized_model(get_flavor("debugmodel"))
    with compiled_without_inductor():  # what dynamo compiles is the question, not inductor's kernels
        compile_blocks(compiled)
    g = torch.Generator().manual_seed(4)
    for i, documents in enumerate([[[40, 56], [96]], [[10, 20, 66], [30, 30, 36]], [[96], [96]], [[50, 46], [96]]]):
        if i == 1:
            compiles = counters["frames"]["ok"]
        ids = torch.randint(0, 512, (BATCH, SEQ), generator=g)
        positions = packed_positions(documents)
        layout = document_layout(positions, 2, SEQ, positions.device, packed=True)
        assert_compiled_matches_eager(loss_and_grads(compiled, ids, None, layout=layout),
                                      loss_and_grads(eager, ids, positions),  # [[96], [96]]: the plain layout
                                      documents)
    assert counters["frames"]["ok"] == compiles, "a batch of another layout recompiled the blocks"
    torch._dynamo.reset()
