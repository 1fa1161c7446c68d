"""Worker for test_data_ranks (a run of the shared launches, tests/distributed/launch.py): every rank of a gloo world
builds the token cache of <folder>/<dataset> in <folder>/cache together with the others, recording the work units it
tokenized, then reads one batch. Also runs alone under torchrun, over gloo, or NCCL on GPUs when
DATA_RANKS_BACKEND=nccl (the trainer's order: set the device, then init the group):
`torchrun --nproc_per_node=2 tests/distributed/data_ranks_worker.py FOLDER DATASET UNIT_BYTES`.

Writes <folder>/rank<r>.json: {"units": [[start, stop], ...], "cache": folder, "rows": first batch's input_ids},
or <folder>/rank<r>.error with the exception's type and message when the build fails (alone, it then exits non-zero)."""

import gc
import json
import os
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist

import harness.data.cached
from harness.data import token_cache
from harness.data.loader import build_dataloader
from harness.data.tokenizer import ByteTokenizer


def build(folder: str, dataset: str, unit_bytes: str) -> bool:
    """Whether the build succeeded (every rank's answer is the same)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    units, read_unit = [], harness.data.cached.read_unit

    def recording_read_unit(kind, unit, text_field="text"):
        units.append([unit.start, unit.stop])
        return read_unit(kind, unit, text_field)

    with (mock.patch.object(harness.data.cached, "UNIT_BYTES", int(unit_bytes)),
          mock.patch.object(harness.data.cached, "read_unit", recording_read_unit)):
        try:
            loader = build_dataloader("jsonl", os.path.join(folder, dataset), "text", ByteTokenizer(), 16, 2,
                                      dp_rank=rank, dp_world_size=world, cache_dir=os.path.join(folder, "cache"))
        except Exception as e:
            Path(folder, f"rank{rank}.error").write_text(f"{type(e).__name__}: {e}")
            dist.barrier()  # both ranks got here and wrote their error before either goes on
            return False
        rows = next(loader)["input_ids"].tolist()
    Path(folder, f"rank{rank}.json").write_text(json.dumps({"units": units, "cache": str(loader.cache.folder),
                                                            "rows": rows}))
    return True


def reopen_damaged(folder: str, dataset: str) -> None:
    """Both ranks build the cache (a sample of 2 blocks of 4 tokens), rank 0 changes a token outside the sample, and
    both reopen it asking for the full check, which rank 0 alone runs: each writes <folder>/rank<r>.error."""
    rank = dist.get_rank()
    with (mock.patch.object(token_cache, "SAMPLE_BLOCKS", 2), mock.patch.object(token_cache, "SAMPLE_BLOCK_TOKENS", 4)):
        def open_it(verify):
            return build_dataloader("jsonl", os.path.join(folder, dataset), "text", ByteTokenizer(), 16, 2,
                                    dp_rank=rank, dp_world_size=2, cache_dir=os.path.join(folder, "cache"),
                                    cache_verify=verify)

        tokens_file = open_it("quick").cache.folder / token_cache.TOKENS_FILE
        dist.barrier()
        if rank == 0:
            tokens = np.memmap(tokens_file, dtype=np.uint32, mode="r+")
            tokens[len(tokens) // 2] ^= 1  # another byte value: inside the vocabulary
            tokens.flush()
        dist.barrier()
        try:
            open_it("full")
        except Exception as e:
            Path(folder, f"rank{rank}.error").write_text(f"{type(e).__name__}: {e}")
    dist.barrier()


def main(folder: str, dataset: str, unit_bytes: str) -> None:
    backend = os.environ.get("DATA_RANKS_BACKEND", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    built = build(folder, dataset, unit_bytes)
    dist.destroy_process_group()
    if not built:
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(*sys.argv[1:])
    gc.collect()  # the process groups freed before the interpreter finalizes (harness/train.py)
