"""FLA's varlen chunk index built on the host (models/qwen35_moe/kernels/fla_varlen.py) against a loop over the documents
(on GPU it is also compared with FLA's own, tests/gpu/test_fla_kernels.py)."""

import pytest
import torch

from models.qwen35_moe.kernels.fla_varlen import fla_chunk_indices, fla_varlen_args, uploaded_chunk_indices


def chunk_rows(cu_seqlens: list[int], chunk_size: int) -> list[list[int]]:
    rows = []
    for document, (start, end) in enumerate(zip(cu_seqlens, cu_seqlens[1:])):
        rows += [[document, chunk] for chunk in range(-(-(end - start) // chunk_size))]
    return rows


@pytest.mark.parametrize("cu_seqlens", [[0, 4096], [0, 1, 64, 65, 193, 256], [0, 190, 701, 1000], [0, 64, 128]])
def test_chunk_index_lists_every_chunk_of_every_document(cu_seqlens):
    got = fla_chunk_indices(torch.tensor(cu_seqlens, dtype=torch.int32))
    assert got.tolist() == chunk_rows(cu_seqlens, 64)
    assert fla_chunk_indices(torch.tensor(cu_seqlens), 16).tolist() == chunk_rows(cu_seqlens, 16)


def test_a_layout_uploads_its_index_once():
    host = torch.tensor([0, 100, 300], dtype=torch.int32)
    first = uploaded_chunk_indices(host, host)
    assert uploaded_chunk_indices(host, host) is first  # the next layer of the step
    assert uploaded_chunk_indices(host.clone(), host) is not first  # the next step's layout
    assert uploaded_chunk_indices(host, host.long()).dtype == torch.int64  # FLA's: cu_seqlens' dtype


def test_varlen_args_take_the_host_copy_or_the_host_tensor_itself():
    host = torch.tensor([0, 100, 300], dtype=torch.int32)
    given = fla_varlen_args(host.clone(), host, torch.device("cpu"))  # a device tensor and its host copy
    assert given["cu_seqlens_cpu"] is host and given["cu_seqlens"].dtype == torch.int32
    assert torch.equal(given["chunk_indices"], fla_chunk_indices(host).int())
    derived = fla_varlen_args(host, None, torch.device("cpu"))  # cu_seqlens on the host serves as its own copy
    assert derived["cu_seqlens_cpu"] is host and derived["chunk_indices"] is not None
    assert fla_varlen_args(host.short(), None, torch.device("cpu"))["cu_seqlens"].dtype == torch.int64
    assert fla_varlen_args(None, None, torch.device("cpu")) == {"cu_seqlens": None, "cu_seqlens_cpu": None,
                                                               "chunk_indices": None}
