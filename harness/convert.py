"""Offline DCP -> Hugging Face conversion of one checkpoint step, in one CPU process (no torchrun, no GPU).

    python -m harness.convert <dump_folder>/checkpoint/step-N <hf_out_dir> [--dtype bfloat16] [--max-shard-gib 5]

Reads the model weights only (never the optimizer state), one tensor at a time, and writes each to its output
shard as it comes: memory stays at a few times the largest tensor (DCP reads a tensor's bytes, then builds it; an
MTP layer's two fused expert tensors are held together while the per-expert tensors cut from them are written),
whatever the shard size (5 GiB by default). The model's config.json and the tokenizer files come from the step's hf/
folder, which the trainer writes beside every checkpoint. The output is the end-of-run export's layout and bytes:
the same shard plan, names, dtypes (A_log, dt_bias and the GDN norm in F32) and metadata.

Only a complete step is converted (one with the COMPLETE the trainer writes last), and its files are first checked
against the digests COMPLETE records (a step saved before they were recorded converts with a warning). The output is
written into <hf_out_dir>.tmp and renamed into place: an interrupted or refused write (a full disk) never leaves a
folder that looks complete. An existing <hf_out_dir> is replaced only if it is empty or an export of this program (it
holds qwen35_titan_export.json), never when it holds the step (the run's folder): anything else is refused, as is a
<hf_out_dir>.tmp or .old beside it that is not a leftover of an export. Reading a checkpoint unpickles DCP's .metadata
(torch's format): a checkpoint from someone else is code; convert only your own or ones you trust.
Exit codes: 0 done, 2 bad input (one `error:` line).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from models.qwen35_moe import Qwen35MoeArgs, Qwen35MoeStateDictAdapter

from .checkpoint.checkpointer import model_tensors
from .checkpoint.errors import CheckpointError
from .checkpoint.step_folders import step_folders
from .checkpoint.hf_weights import ExportTensors, check_hf_export_folder, write_hf_folder
from .checkpoint.integrity import COMPLETE, check_files, hash_threads, read_complete

warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConvertError(ValueError):
    """Bad input: the message names the folder or file at fault."""


def convert(step_dir: str | Path, out_dir: str | Path, dtype: str | None = None, max_shard_gib: float = 5.0) -> Path:
    step_dir = Path(step_dir)
    meta_dir = step_dir / "hf"
    if not (step_dir / ".metadata").is_file():
        hint = " (it holds step-N folders: name one of them)" if any(step_dir.glob("step-*")) else ""
        raise ConvertError(f"{step_dir} is not a DCP checkpoint step folder: it has no .metadata{hint}")
    check_hf_export_folder(out_dir, source=step_dir)  # before the step's files are hashed: a refusal costs nothing
    verify(step_dir)
    if not (meta_dir / "config.json").is_file():
        raise ConvertError(f"{meta_dir / 'config.json'} is missing: the trainer writes it beside every checkpoint; "
                           "was this folder saved by another program?")
    config = json.loads((meta_dir / "config.json").read_text())
    args = Qwen35MoeArgs.from_hf_config(config)  # bos / eos ids included
    export_dtype = DTYPES[dtype or config.get("dtype", "bfloat16")]
    adapter = Qwen35MoeStateDictAdapter(args)

    saved = model_tensors(FileSystemReader(str(step_dir)).read_metadata())

    def read(key: str) -> torch.Tensor:  # one native tensor: DCP reads only it (never the optimizer state)
        wanted = {f"model.{key}": torch.empty(tuple(saved[key].size), dtype=saved[key].properties.dtype)}
        try:
            dcp.load(wanted, checkpoint_id=str(step_dir), no_dist=True)
        except (Exception, CheckpointException) as e:  # an unverified (old) step's damage; DCP's wrapper is a
            cause = next(iter(e.failures.values()))[0] if getattr(e, "failures", None) else e  # BaseException
            raise ConvertError(f"cannot read {key} from {step_dir}: {str(cause).strip().splitlines()[0]}")
        return wanted.popitem()[1]

    tensors = ExportTensors(adapter, {k: tuple(md.size) for k, md in saved.items()}, export_dtype, read)

    def extra_files(tmp: Path) -> None:  # tokenizer and generation config, as the run exported them
        for path in meta_dir.iterdir():
            if path.name != "config.json":
                (shutil.copytree if path.is_dir() else shutil.copy2)(path, tmp / path.name)

    write_hf_folder(out_dir, args, export_dtype, tensors.specs, tensors.fetch, extra_files,
                    max_shard_bytes=int(max_shard_gib * 1024**3), source=step_dir)
    return Path(out_dir)


def verify(step_dir: Path) -> None:
    """Refuse a step without COMPLETE or whose files differ from COMPLETE's digests (ConvertError, naming them)."""
    if not (step_dir / COMPLETE).is_file():
        complete = ", ".join(f"step-{s}" for s in sorted(step_folders(step_dir.parent))) or "none"
        raise ConvertError(f"{step_dir} has no {COMPLETE}: its save never finished, so its files may be partial; "
                           f"convert a complete step (complete ones beside it: {complete})")
    try:
        record = read_complete(step_dir)
    except ValueError as e:
        raise ConvertError(f"{step_dir}: {e}") from None
    if "files" not in record:
        print(f"warning: {step_dir} has no checksums (saved before they were recorded): converting it unverified",
              file=sys.stderr)
        return
    problem = check_files(step_dir, record, threads=hash_threads())
    if problem is not None:
        raise ConvertError(f"checkpoint {step_dir} failed verification: {problem}; convert another step")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.convert", description=__doc__.split("\n\n")[0],
                                     epilog="Reading a checkpoint unpickles its DCP .metadata (torch's format): a "
                                     "checkpoint from someone else is code; convert only your own or ones you trust.")
    parser.add_argument("step_dir", help="a checkpoint step folder, <dump_folder>/checkpoint/step-N")
    parser.add_argument("out_dir", help="the Hugging Face folder to write: a new or empty folder, or an earlier export "
                        "(replaced); never the run's folder or any other folder of files")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="export dtype (default: the run's checkpoint.export_dtype)")
    parser.add_argument("--max-shard-gib", type=float, default=5.0, help="largest output shard (default 5)")
    args = parser.parse_args(argv)
    try:
        out = convert(args.step_dir, args.out_dir, args.dtype, args.max_shard_gib)
    except (ConvertError, CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
