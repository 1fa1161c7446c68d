"""Reading and writing Hugging Face checkpoint folders (config.json + safetensors) on one process."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .args import Qwen35MoeArgs
from .model import Qwen35MoeModel
from .state_dict_adapter import Qwen35MoeStateDictAdapter, hf_export_dtype

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_hf_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors checkpoint folder, single file or sharded with an index."""
    folder = Path(folder)
    if (folder / INDEX_FILE).is_file():
        weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"{folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
    state = {}
    for name in files:
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} is named in {INDEX_FILE} but does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    state[key] = f.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types for truncated / corrupt files
            raise ValueError(f"cannot read {path}: {e}") from e
    return state


def save_hf_checkpoint(
    state_dict: dict[str, torch.Tensor],
    args: Qwen35MoeArgs,
    folder: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = 5 * 1024**3,
    extra_files: Callable[[Path], None] | None = None,
) -> Path:
    """Write a native state dict as a text-only HF CausalLM folder that transformers loads.

    A_log, dt_bias and the GDN output norm are written in fp32, everything else in `dtype`. Files are
    written to a fresh temporary folder (whatever an earlier interrupted export left there is deleted
    first), the shard index last, then `extra_files(temporary_folder)` adds what must be published with the
    weights (the tokenizer). Every file is made readable by all (0644, folders 0755, less the umask),
    everything is flushed to disk, then the folder is renamed into place: an interrupted export never leaves
    a half-written or mixed folder under the final name.
    """
    folder = Path(folder)
    hf = Qwen35MoeStateDictAdapter(args).to_hf(state_dict)
    hf = {k: v.detach().to("cpu", hf_export_dtype(k, dtype)).contiguous() for k, v in hf.items()}

    shards, current, size = [], {}, 0
    for key in sorted(hf):
        nbytes = hf[key].numel() * hf[key].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = hf[key]
        size += nbytes
    shards.append(current)

    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():  # an earlier export died here: none of its files may end up in this one
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    dtype_name = str(dtype).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(args.to_hf_config(dtype_name), indent=2) + "\n")
    if len(shards) == 1:
        save_file(shards[0], str(tmp / SINGLE_FILE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in hf.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")  # after the shards: it names them
    if extra_files is not None:
        extra_files(tmp)
    _make_readable(tmp)
    _fsync_folder(tmp)
    if folder.exists():
        backup = folder.with_name(folder.name + ".old")
        if backup.exists():  # left by an export that died between the two renames
            shutil.rmtree(backup)
        folder.rename(backup)
        tmp.rename(folder)
        shutil.rmtree(backup)
    else:
        tmp.rename(folder)
    return folder


def _make_readable(folder: Path) -> None:
    """Give every file 0644 and every folder 0755, less the umask, the modes open() and mkdir() give by default:
    safetensors writes through a private temporary file, which leaves the weights 0600, readable by us alone."""
    umask = os.umask(0o022)  # the only way to read the umask is to set it; put it back at once
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o755 if path.is_dir() else 0o644) & ~umask)


def _fsync_folder(folder: Path) -> None:
    """Flush every file under `folder`, then the folders, so a rename after this publishes complete files."""
    for path in folder.iterdir():
        if path.is_dir():
            _fsync_folder(path)
            continue
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def from_pretrained(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Qwen35MoeModel:
    """Our native model with the weights of a transformers Qwen3.5-MoE checkpoint folder.

    Reads config.json (text-only or multimodal) and the safetensors weights (single or sharded). The
    model is in `dtype` except the SSM gate parameters, which stay fp32.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint folder {path} does not exist")
    args = Qwen35MoeArgs.from_hf_config(path)
    native = Qwen35MoeStateDictAdapter(args).from_hf(load_hf_state_dict(path))
    with torch.device("meta"):
        model = Qwen35MoeModel(args)
    model.to(dtype)  # on meta: only records dtypes, so weights are materialised once, in `dtype`
    model.to_empty(device=device)
    model.load_state_dict(native, strict=True)
    return model
