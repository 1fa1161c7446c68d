"""Offline DCP -> Hugging Face conversion of one checkpoint step, in one CPU process (no torchrun, no GPU).

    python -m harness.convert <dump_folder>/checkpoint/step-N <hf_out_dir> [--dtype bfloat16] [--max-shard-gib 5]
                              [--base <hf_folder>] [--quantized fp8]

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

A LoRA run's step holds its adapters only (its train state names their settings and the base they were trained on,
with a digest of it: harness/lora/base.py). Through the run's LoRA part (harness/lora/run.py) it converts into the
base with the adapters merged (each adapted weight W + s * B A, summed in fp32: the end-of-run export's files) at
<hf_out_dir>, and into a PEFT adapter folder at <hf_out_dir>-adapter (harness/lora/peft.py), one unit. The base is
read, one tensor at a time, from the HF folder the run loaded it from, or from --base (a copy of it moved elsewhere); a base whose digest is not the saved
one is refused (exit 2). A base the run drew from the seed is drawn again here, on the CPU (the whole model in
memory: debug sizes): a run drawn on a GPU drew other numbers and is refused by the digest only if it records the
device.
Exit codes: 0 done, 2 bad input (one `error:` line).
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from models.qwen35_moe import Qwen35MoeArgs
from models.qwen35_moe.lora_targets import is_adapter_key

from .checkpoint.checkpointer import model_tensors
from .checkpoint.errors import CheckpointError
from .checkpoint.fp8_export import QUANTIZED_EXPORTS
from .checkpoint.hf_weights import ExportUnit, check_hf_export_folder, write_native_export
from .checkpoint.integrity import COMPLETE, check_files, hash_threads, read_complete
from .checkpoint.plain_state import from_bytes
from .checkpoint.step_folders import step_folders
from .cli_parser import OneLineParser
from .lora.run import LoraRun
from .run_outputs import adapter_folder

warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ConvertError(ValueError):
    """Bad input: the message names the folder or file at fault."""


def convert(step_dir: str | Path, out_dir: str | Path, dtype: str | None = None, max_shard_gib: float = 5.0,
            base: str | None = None, quantized: str = "none") -> list[Path]:
    """Write the step's HF folder at `out_dir` (and, for a LoRA step, its PEFT adapter beside it, published with it
    as one unit); `base`: the HF folder of a LoRA run's base, if not where the run loaded it from; `quantized` "fp8":
    the model re-quantized into the FP8 release's layout (harness/checkpoint/fp8_export.py). Returns the folders
    written."""
    step_dir = Path(step_dir)
    meta_dir = step_dir / "hf"
    if not step_dir.is_dir():
        raise ConvertError(f"{step_dir}: no such folder" if not step_dir.exists() else
                           f"{step_dir} is a file, not a checkpoint step folder")
    if not (step_dir / ".metadata").is_file():
        hint = " (it holds step-N folders: name one of them)" if any(step_dir.glob("step-*")) else ""
        raise ConvertError(f"{step_dir} is not a DCP checkpoint step folder: it has no .metadata{hint}")
    try:
        metadata = FileSystemReader(str(step_dir)).read_metadata()
    except Exception as e:  # a truncated or foreign .metadata: unpickling raises many types
        raise ConvertError(f"{step_dir / '.metadata'} is unreadable ({type(e).__name__}: {e}): a damaged or partial "
                           "checkpoint; convert another step") from None
    saved = model_tensors(metadata)
    lora = bool(saved) and all(map(is_adapter_key, saved))  # a LoRA run saves its adapters only
    if base is not None and not lora:
        raise ConvertError(f"--base is for a LoRA run's checkpoint; {step_dir} holds a whole model's weights")
    # before the step's files are hashed: a refusal costs nothing
    for folder in (out_dir, adapter_folder(out_dir)) if lora else (out_dir,):
        check_hf_export_folder(folder, source=step_dir)
    verify(step_dir)
    if not (meta_dir / "config.json").is_file():
        raise ConvertError(f"{meta_dir / 'config.json'} is missing: the trainer writes it beside every checkpoint; "
                           "was this folder saved by another program?")
    try:
        config = json.loads((meta_dir / "config.json").read_text())
        args = Qwen35MoeArgs.from_hf_config(config)  # bos / eos ids included
    except ValueError as e:  # bad JSON, or not a config of this model
        raise ConvertError(f"{meta_dir / 'config.json'}: {e}") from None
    export_dtype = DTYPES[dtype or config.get("dtype", "bfloat16")]

    def read(key: str) -> torch.Tensor:  # one native tensor: DCP reads only it (never the optimizer state)
        wanted = {f"model.{key}": torch.empty(tuple(saved[key].size), dtype=saved[key].properties.dtype)}
        return _load(step_dir, wanted, key)[f"model.{key}"]

    def extra_files(tmp: Path) -> None:  # tokenizer and generation config, as the run exported them
        for path in meta_dir.iterdir():
            if path.name != "config.json":
                (shutil.copytree if path.is_dir() else shutil.copy2)(path, tmp / path.name)

    shapes = {k: tuple(md.size) for k, md in saved.items()}
    part = _lora_run(step_dir, args, shapes, base) if lora else None
    if part is not None:  # the base's tensors beside the adapters: merged, and the PEFT adapter beside them
        try:
            base_shapes, base_read = part.base_tensors(args)
        except (ValueError, FileNotFoundError) as e:
            raise ConvertError(f"the base {part.base}: {e}") from None
        shapes, read = base_shapes | shapes, _either(read, base_read)
    notes = []
    options = {"extra_files": extra_files, "max_shard_bytes": int(max_shard_gib * 1024**3), "source": step_dir}
    with ExportUnit() as unit:  # a LoRA step's merged model and adapter: both written, or neither
        if part is not None:
            notes = part.write_exports(out_dir, args, export_dtype, shapes, read, unit, quantized=quantized, **options)
        else:
            write_native_export(out_dir, args, export_dtype, shapes, read, unit=unit, quantized=quantized, **options)
    for note in notes:
        print(note)
    return [folder.resolve() for _, folder in unit.written]


def _either(read_adapter, read_base):
    """The reader of a LoRA step's native keys: its adapters from the checkpoint, the rest from the base."""
    return lambda key: read_adapter(key) if is_adapter_key(key) else read_base(key)


def _load(step_dir: Path, wanted: dict, what: str) -> dict:
    """dcp.load of `wanted` from the step, its failure one ConvertError naming `what`."""
    try:
        dcp.load(wanted, checkpoint_id=str(step_dir), no_dist=True)
    except (Exception, CheckpointException) as e:  # an unverified (old) step's damage; DCP's wrapper is a
        cause = next(iter(e.failures.values()))[0] if getattr(e, "failures", None) else e  # BaseException
        raise ConvertError(f"cannot read {what} from {step_dir}: {str(cause).strip().splitlines()[0]}")
    return wanted


def _lora_run(step_dir: Path, args: Qwen35MoeArgs, adapters: dict[str, tuple[int, ...]],
              base: str | None) -> LoraRun:
    """The LoRA of the run that saved a step holding the adapters `adapters` (its train state's record), checked: the
    adapters are the ones it describes, and its base (`base`: where it moved, if given) is there with the digest
    the run saved. ConvertError naming the step otherwise."""
    train = from_bytes(_load(step_dir, {"train": b""}, "the train state")["train"], "train", step_dir)
    record = train.get("lora")
    if not record:
        raise ConvertError(f"{step_dir} holds LoRA adapters only, but its train state names no LoRA run (no 'lora' "
                           "entry): was it saved by another program?")
    seed = ((train.get("run_config") or {}).get("training") or {}).get("seed")
    part = LoraRun.from_record(record, seed, base)
    problem = part.adapters_problem(args, adapters) or part.base_problem(args, record["base"])
    if problem is not None:
        raise ConvertError(f"{step_dir}: {problem}")
    return part


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


def _shard_gib(text: str) -> float | None:
    """The --max-shard-gib value; None if it is not a positive number."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 < value < float("inf") else None


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m harness.convert", help_command="python -m harness.convert --help",
                           description=__doc__.split("\n\n")[0],
                           epilog="Reading a checkpoint unpickles its DCP .metadata (torch's format): a "
                           "checkpoint from someone else is code; convert only your own or ones you trust.")
    parser.add_argument("step_dir", help="a checkpoint step folder, <dump_folder>/checkpoint/step-N")
    parser.add_argument("out_dir", help="the Hugging Face folder to write: a new or empty folder, or an earlier export "
                        "(replaced); never the run's folder or any other folder of files")
    parser.add_argument("--dtype", default=None, metavar="{" + ",".join(DTYPES) + "}",
                        help="export dtype (default: the run's checkpoint.export_dtype)")
    parser.add_argument("--max-shard-gib", default="5", help="largest output shard (default 5)")
    parser.add_argument("--quantized", default="none", metavar="{" + ",".join(QUANTIZED_EXPORTS) + "}",
                        help="fp8: the model re-quantized block-wise into the FP8 release's layout (default none)")
    parser.add_argument("--base", default=None, help="a LoRA run's checkpoint: the HF folder of the base its adapters "
                        "were trained on (default: where the run loaded it from; its digest must be the saved one)")
    args = parser.parse_args(argv)
    shard_gib = _shard_gib(args.max_shard_gib)
    problems = []  # every one at once, as the trainer names a config's
    if args.dtype is not None and args.dtype not in DTYPES:
        problems.append(f"--dtype {args.dtype!r} is not one of {', '.join(DTYPES)}")
    if args.quantized not in QUANTIZED_EXPORTS:
        problems.append(f"--quantized {args.quantized!r} is not one of {', '.join(QUANTIZED_EXPORTS)}")
    if shard_gib is None:
        problems.append(f"--max-shard-gib {args.max_shard_gib!r} is not a positive number of GiB")
    if problems:
        print(f"error: {'; '.join(problems)}", file=sys.stderr)
        return 2
    try:
        written = convert(args.step_dir, args.out_dir, args.dtype, shard_gib, args.base, args.quantized)
    except (ConvertError, CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len(written) == 2:
        print(f"wrote {written[0]} (the merged model) and {written[1]} (the PEFT adapter)")
    else:
        print(f"wrote {written[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
