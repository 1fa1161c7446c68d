"""What a LoRA run's checkpoints record of the frozen base they were trained on, and the check that a resume (or an
export) loads that same base: a checkpoint holds only the adapters, which mean nothing on other weights.

The digest of an HF folder is a sha256 over each safetensors file's header (every tensor's name, dtype, shape and
place) and, per tensor, three 4 KiB samples of its bytes (start, middle, end): any other checkpoint, a fine-tune
of the same one among them (it changes every tensor), gives another digest, while reading ~12 KiB a tensor (a
second for the 35B-A3B's ~2,000 tensors, against minutes to hash its 67 GB). A base drawn from the seed (no
checkpoint.initial_load_hf) is named by the seed, the model's shape (not its token ids: no part of the weights) and
the device type that drew it (CPU and CUDA generators draw different numbers).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from pathlib import Path

from models.qwen35_moe import Qwen35MoeArgs
from models.qwen35_moe.hf_checkpoint import read_safetensors_header
from models.qwen35_moe.lora_targets import LoraArgs

SAMPLE_BYTES = 4096


def base_digest(source: str, seed: int, args: Qwen35MoeArgs, device: str = "cpu") -> str:
    """The digest of the base a LoRA run starts from: the HF folder `source`, or (source "") the seed's init drawn on
    a `device` ("cpu", "cuda"). ValueError for a file that is not safetensors (read_safetensors_header)."""
    digest = hashlib.sha256()
    if not source:
        shape = dataclasses.asdict(dataclasses.replace(args, bos_token_id=None, eos_token_id=None, pad_token_id=None))
        digest.update(json.dumps({"seed": seed, "model": shape, "device": device}, sort_keys=True).encode())
        return f"seed-{device}:" + digest.hexdigest()
    folder = Path(source)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else [folder]
    for path in files:
        tensors = read_safetensors_header(path)  # ValueError for a damaged or hostile one
        with open(path, "rb") as f:
            length = struct.unpack("<Q", f.read(8))[0]
            digest.update(path.name.encode() + f.read(length))
            for name in sorted(tensors):
                start, end = (8 + length + offset for offset in tensors[name]["data_offsets"])
                for at in sorted({start, max(start, (start + end) // 2 - SAMPLE_BYTES // 2),
                                  max(start, end - SAMPLE_BYTES)}):
                    f.seek(at)
                    digest.update(f.read(min(SAMPLE_BYTES, end - at)))
    return "sha256-sampled:" + digest.hexdigest()


def lora_record(lora, source: str, seed: int, args: Qwen35MoeArgs, device: str) -> dict:
    """The train state's "lora" entry: the adapters' settings and the base's digest and source."""
    settings = dataclasses.asdict(lora) | {"targets": list(lora.targets)}
    return {"args": settings, "base": {"digest": base_digest(source, seed, args, device), "source": source}}


def lora_problem(saved: dict | None, ours: dict | None) -> str | None:
    """Why a checkpoint whose train state holds `saved` (its "lora" entry, None: a full fine-tune) cannot resume a
    run whose entry is `ours`; None if it can."""
    if saved is None and ours is None:
        return None
    if saved is None:
        return "it holds a full fine-tune's weights, and this run trains LoRA adapters (lora.enable)"
    if ours is None:
        return "it holds LoRA adapters only, and this run trains every weight (set lora.enable and its settings)"
    # a setting saved before it existed had its default (LoraArgs')
    saved_args = {field.name: field.default for field in dataclasses.fields(LoraArgs)
                  if field.default is not dataclasses.MISSING} | saved["args"]
    changed = [f"lora.{key} {saved_args.get(key)} (now {ours['args'][key]})" for key in ours["args"]
               if saved_args.get(key) != ours["args"][key]]
    if changed:
        return "its adapters were trained with other settings: " + ", ".join(changed)
    if saved["base"]["digest"] != ours["base"]["digest"]:
        return (f"its adapters were trained on another base ({saved['base']['source'] or 'the seed init'}, digest "
                f"{saved['base']['digest'][:30]}...), not on this run's ({ours['base']['source'] or 'the seed init'}, "
                f"{ours['base']['digest'][:30]}...)")
    return None
