"""FLA's varlen arguments for its kernels (Gated DeltaNet, causal conv): cu_seqlens, its host copy, and the chunk
index, built on the host.

FLA's varlen kernels take, besides cu_seqlens, a chunk index: one row (document, chunk within the document) per
64-token chunk (fla.ops.utils.index.prepare_chunk_indices). Left to FLA, it is built from the host copy of
cu_seqlens and uploaded with a blocking copy, a host sync each step that drains the GPU's queue. We build it on
the host too and copy it from pinned memory without waiting, once for all the layers of a step.
"""

from __future__ import annotations

import torch

from ..documents import to_device

FLA_CHUNK_SIZE = 64  # the chunk size of FLA 0.6's chunk_gated_delta_rule and causal_conv1d


def fla_chunk_indices(cu_seqlens: torch.Tensor, chunk_size: int = FLA_CHUNK_SIZE) -> torch.Tensor:
    """(chunks, 2): for each chunk of each document, in order, the document and the chunk's place in it."""
    lens = cu_seqlens[1:].long() - cu_seqlens[:-1].long()
    chunks = (lens + chunk_size - 1) // chunk_size
    document = torch.repeat_interleave(torch.arange(len(chunks), device=chunks.device), chunks)
    first = chunks.cumsum(0) - chunks  # each document's first chunk
    within = torch.arange(len(document), device=chunks.device) - first[document]
    return torch.stack((document, within), 1)


_last: tuple = (None, None)  # (host cu_seqlens, its chunk index on the device): the step's layout


def uploaded_chunk_indices(cu_seqlens_cpu: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The chunk index of `cu_seqlens_cpu` on cu_seqlens' device and in its dtype (as FLA builds it), copied
    without a host sync; built once per layout (the layers of a step share theirs)."""
    global _last
    host, uploaded = _last
    if host is not cu_seqlens_cpu or uploaded.device != cu_seqlens.device or uploaded.dtype != cu_seqlens.dtype:
        uploaded = to_device(fla_chunk_indices(cu_seqlens_cpu).to(cu_seqlens.dtype), cu_seqlens.device)
        _last = (cu_seqlens_cpu, uploaded)
    return uploaded


def fla_varlen_args(cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None,
                    device: torch.device) -> dict:
    """The keyword arguments FLA's varlen kernels take: cu_seqlens on `device` (FLA indexes with int32 or int64),
    a host copy (spares FLA a device-to-host sync; cu_seqlens itself when it is on the host) and the chunk index
    uploaded from it."""
    if cu_seqlens is None:
        return {"cu_seqlens": None, "cu_seqlens_cpu": cu_seqlens_cpu, "chunk_indices": None}
    if cu_seqlens_cpu is None and cu_seqlens.device.type == "cpu":
        cu_seqlens_cpu = cu_seqlens
    dtype = cu_seqlens.dtype if cu_seqlens.dtype in (torch.int32, torch.int64) else torch.int64
    cu_seqlens = cu_seqlens.to(device=device, dtype=dtype)
    chunk_indices = None if cu_seqlens_cpu is None else uploaded_chunk_indices(cu_seqlens_cpu, cu_seqlens)
    return {"cu_seqlens": cu_seqlens, "cu_seqlens_cpu": cu_seqlens_cpu, "chunk_indices": chunk_indices}
