"""Worker for test_data_ranks: every rank of a gloo world builds the token cache of one jsonl file together
with the others, recording the work units it tokenized, then reads one batch. Run with torchrun; gloo, or NCCL
on GPUs when DATA_RANKS_BACKEND=nccl (the trainer's order: set the device, then init the group).

Writes <out>/rank<r>.json: {"units": [[start, stop], ...], "cache": folder, "rows": first batch's input_ids},
or <out>/rank<r>.error with the message when the build fails (then exits non-zero)."""

import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import harness.data.loader
from harness.data.loader import build_dataloader
from harness.data.tokenizer import ByteTokenizer


def main(dataset: str, cache_dir: str, out: str, unit_bytes: str) -> None:
    backend = os.environ.get("DATA_RANKS_BACKEND", "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    harness.data.loader.UNIT_BYTES = int(unit_bytes)
    units, read_unit = [], harness.data.loader.read_unit

    def recording_read_unit(kind, unit, text_field="text"):
        units.append([unit.start, unit.stop])
        return read_unit(kind, unit, text_field)

    harness.data.loader.read_unit = recording_read_unit
    try:
        loader = build_dataloader("jsonl", dataset, "text", ByteTokenizer(), 16, 2, dp_rank=rank, dp_world_size=world,
                                  cache_dir=cache_dir)
    except Exception as e:
        Path(out, f"rank{rank}.error").write_text(str(e))
        dist.barrier()  # both ranks got here and wrote their error before either exits
        raise
    rows = next(loader)["input_ids"].tolist()
    Path(out, f"rank{rank}.json").write_text(json.dumps({"units": units, "cache": str(loader.cache.folder),
                                                         "rows": rows}))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(*sys.argv[1:])
    gc.collect()  # the process groups freed before the interpreter finalizes (harness/train.py)
