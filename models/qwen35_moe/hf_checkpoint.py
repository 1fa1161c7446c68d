"""Reading and writing Hugging Face checkpoint folders (config.json + safetensors) on one process."""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from .args import Qwen35MoeArgs
from .fp8_config import folder_quantization_config, quantization_problems
from .fp8_release import FP8_DTYPE, Fp8ReleaseTensors
from .model import Qwen35MoeModel
from .state_dict_adapter import Qwen35MoeStateDictAdapter, hf_export_dtype

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 1024**3  # transformers' default shard size
# In every export (and in its temporary folder from the moment it is created): the sign that the folder is an export
# of this program, which a later export may replace. Constant, so the converter and the trainer write the same bytes.
EXPORT_MARKER = "qwen35_titan_export.json"
_MARKER_TEXT = json.dumps({"written_by": "qwen35-titan", "note": "a Hugging Face export of qwen35-titan: "
                           "a later export to this folder replaces the whole folder"}, indent=2) + "\n"


class ExportFolderRefused(FileExistsError):
    """An export would replace or delete a folder that is not an export of this program (`export_folder_refusal`)."""


class HFCheckpointReader:
    """A safetensors checkpoint folder (single file or sharded with an index), read one tensor at a time.

    `keys()`, `shape(key)` and `dtype(key)` (the header's dtype string, e.g. "BF16", "F8_E4M3") come from the file
    headers alone; `read(key)` loads one tensor."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        if (folder / INDEX_FILE).is_file():
            try:
                weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
                if not all(isinstance(v, str) for v in weight_map.values()):
                    raise TypeError("a file name that is not a string")
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{folder / INDEX_FILE} is not a safetensors index (a JSON object whose weight_map "
                                 f"maps tensor names to file names): {type(e).__name__}: {e}") from None
        elif (folder / SINGLE_FILE).is_file():
            weight_map = None
        else:
            raise FileNotFoundError(f"{folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
        self._file_of, self._shapes, self._dtypes, self._open = {}, {}, {}, {}
        for name in files:
            path = folder / name
            if not path.is_file():
                raise FileNotFoundError(f"{path} is named in {INDEX_FILE} but does not exist")
            for key, entry in read_safetensors_header(path).items():
                self._file_of[key] = path
                self._shapes[key] = tuple(entry["shape"])
                self._dtypes[key] = entry["dtype"]

    def keys(self) -> list[str]:
        return list(self._file_of)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shapes[key]

    def dtype(self, key: str) -> str:
        return self._dtypes[key]

    def read(self, key: str) -> torch.Tensor:
        path = self._file_of[key]
        try:
            if path not in self._open:  # opened once: each opening parses the whole header (64k entries in the FP8
                self._open[path] = safe_open(str(path), framework="pt")  # release's shards: 0.17 s a read)
            return self._open[path].get_tensor(key)
        except Exception as e:
            raise ValueError(f"cannot read {key} from {path}: {e}") from e


MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own bound on a header (its Rust reader refuses larger)
_MAX_JSON_DEPTH = 8  # a header is an object of objects holding lists of numbers: depth 4 at most


def _bracket_depth(text: bytes, chunk: int = 1 << 24) -> int:
    """The deepest nesting of [ and { in `text`, brackets inside strings too (a bound, not a parse). Vectorised, a
    chunk at a time: a Python loop over the bytes takes seconds on an FP8 release's 10 MB headers."""
    data, depth, deepest = bytearray(text), 0, 0
    for start in range(0, len(data), chunk):
        codes = torch.frombuffer(data, dtype=torch.uint8, offset=start, count=min(chunk, len(data) - start))
        steps = (codes == ord("[")).int() + (codes == ord("{")).int() - (codes == ord("]")).int() - \
            (codes == ord("}")).int()
        running = steps.cumsum(0, dtype=torch.int32) + depth
        deepest, depth = max(deepest, int(running.max())), int(running[-1])
    return deepest


def read_safetensors_header(path: str | Path) -> dict[str, dict]:
    """{tensor name: {"dtype", "shape", "data_offsets"}} of a safetensors file, read from its header alone and
    checked (ValueError naming the file otherwise): the length within the format's bound and the file, JSON no
    deeper than a header is, every entry's shape and byte range whole and inside the file. The one reader of headers
    here: a hostile one (a length of 1e13, JSON nested 10,000 deep) is an error line, never a MemoryError or a
    RecursionError."""
    path = Path(path)

    def refused(why: str) -> ValueError:
        return ValueError(f"cannot read {path}: it is not a safetensors file: {why}")

    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise refused(f"{size} bytes, shorter than its header's length")
        (length,) = struct.unpack("<Q", raw)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise refused(f"its header says {length:,} bytes, more than "
                          f"{'the file holds' if length > size - 8 else 'the format allows'}")
        text = f.read(length)
    deepest = _bracket_depth(text)
    if deepest > _MAX_JSON_DEPTH:
        raise refused(f"its header nests {deepest} levels deep")
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, ValueError) as e:
        raise refused(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise refused("its header is not a JSON object")
    end = size - 8 - length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            shape, (start, stop), dtype = entry["shape"], entry["data_offsets"], entry["dtype"]
            ok = isinstance(dtype, str) and all(isinstance(d, int) and d >= 0 for d in [*shape, start, stop])
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok or not start <= stop <= end:
            raise refused(f"tensor {name!r} has no whole dtype, shape and byte range inside the file")
        tensors[name] = entry
    return tensors


def open_hf_tensors(folder: str | Path) -> HFCheckpointReader | Fp8ReleaseTensors:
    """The tensors of an HF folder: as stored, or, where its config.json has a quantization_config, as an FP8
    release's (checked: ValueError naming every problem). OSError / ValueError for a folder that cannot be read."""
    reader = HFCheckpointReader(folder)
    quant = folder_quantization_config(folder)
    if quant is None:
        if any(reader.dtype(k) == FP8_DTYPE for k in reader.keys()):
            raise ValueError("it holds float8 tensors but its config.json has no quantization_config: not a layout "
                             "this project reads")
        return reader
    problems = quantization_problems(quant)
    if problems:
        raise ValueError("its config.json: " + "; ".join(problems))
    return Fp8ReleaseTensors(reader, quant.get("modules_to_not_convert"))


def load_hf_state_dict(folder: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors checkpoint folder, single file or sharded with an index; an FP8 release's
    weights dequantized to fp32 (fp8_release.py)."""
    reader = open_hf_tensors(folder)
    return {key: reader.read(key) for key in reader.keys()}


def save_hf_checkpoint(
    state_dict: dict[str, torch.Tensor],
    args: Qwen35MoeArgs,
    folder: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    extra_files: Callable[[Path], None] | None = None,
) -> Path:
    """Write a native state dict as a text-only HF CausalLM folder that transformers loads.

    A_log, dt_bias and the GDN output norm are written in fp32, everything else in `dtype`. Files are
    written to a fresh temporary folder (whatever an earlier interrupted export left there is deleted
    first), the shard index last, then `extra_files(temporary_folder)` adds what must be published with the
    weights (the tokenizer). Every file is made readable by all (0644, folders 0755, less the umask),
    everything is flushed to disk, then the folder is renamed into place: an interrupted export never leaves
    a half-written or mixed folder under the final name. An existing folder is replaced only if it is an export of
    this program or empty (ExportFolderRefused, before anything is written, otherwise). (A sharded model is exported
    piece by piece with the same helpers by harness/checkpoint/hf_weights.py.)
    """
    refusal = export_folder_refusal(folder)
    if refusal is not None:
        raise ExportFolderRefused(refusal)
    hf = Qwen35MoeStateDictAdapter(args).to_hf(state_dict)
    specs = {k: (hf_export_dtype(k, dtype), tuple(v.shape)) for k, v in hf.items()}
    shards = plan_shards(specs, max_shard_bytes)
    tmp = fresh_temporary_folder(folder)
    for name, keys in zip(shard_names(len(shards)), shards):
        write_shard(tmp / name, {k: specs[k] for k in keys}, ((k, hf[k].to(specs[k][0])) for k in sorted(keys)))
    return publish_hf_folder(tmp, folder, args, dtype, shards, specs, extra_files)


def tensor_bytes(spec: tuple[torch.dtype, tuple[int, ...]]) -> int:
    dtype, shape = spec
    return math.prod(shape) * torch.finfo(dtype).bits // 8


def plan_shards(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                max_shard_bytes: int = MAX_SHARD_BYTES) -> list[list[str]]:
    """Keys (sorted) cut into consecutive shards of at most `max_shard_bytes` (a larger tensor gets one alone).
    Depends on names, dtypes and shapes only, so every rank, and the offline converter, plan the same files."""
    sizes = {k: tensor_bytes(v) for k, v in specs.items()}
    shards, current, size = [], [], 0
    for key in sorted(sizes):
        if current and size + sizes[key] > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(key)
        size += sizes[key]
    return [*shards, current]


def shard_names(count: int) -> list[str]:
    """File names of `count` shards, as transformers writes them."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def temporary_folder(folder: str | Path) -> Path:
    """`<folder>.tmp`, beside the folder's real path (symlinks resolved), where an export is written."""
    folder = Path(folder).resolve()
    return folder.with_name(folder.name + ".tmp")


def _set_aside_folder(folder: str | Path) -> Path:
    """`<folder>.old`, where an export moves the folder it replaces until the new one is in place."""
    folder = Path(folder).resolve()
    return folder.with_name(folder.name + ".old")


def _replaceable(path: Path) -> bool:
    """Nothing there, an empty folder, or a folder an export of this program wrote (or was writing)."""
    if not path.exists() and not path.is_symlink():
        return True
    if path.is_symlink() or not path.is_dir():
        return False
    return (path / EXPORT_MARKER).is_file() or not any(path.iterdir())


def export_folder_refusal(folder: str | Path, source: str | Path | None = None) -> str | None:
    """Why an export must not be written to `folder`, in one sentence that names the folder at fault and what to do;
    None when it may. An export replaces its whole folder and deletes `<folder>.tmp` and `<folder>.old` beside it
    (what an interrupted export leaves), so each must be absent, an empty folder or one holding EXPORT_MARKER (an
    export of ours; one written before exports were marked is refused: the error says to delete it). `folder` must
    also neither hold nor lie inside `source`, the checkpoint the export is made from (symlinks resolved)."""
    given, target = Path(folder), Path(folder).resolve()
    named = str(given) if str(given) == str(target) else f"{given} ({target})"
    if not target.name:
        return f"{named} is the file system's root: name a new folder for the export"
    if source is not None:
        step = Path(source).resolve()
        instead = f" (such as {step.parent.parent / ('hf-' + step.name)})" if step.name.startswith("step-") else ""
        if target == step or target in step.parents:
            return (f"{named} holds the checkpoint {source}, and an export replaces its whole folder: name an output "
                    f"folder outside it{instead}")
        if step in target.parents:
            return f"{named} lies inside the checkpoint {source}: name an output folder outside it{instead}"
    if not _replaceable(target):
        if not target.is_dir():
            return f"{named} is a file: name a folder for the export"
        return (f"{named} is not empty and is not an export of this program (it has no {EXPORT_MARKER}): an export "
                "replaces its whole folder, so it writes only into a new or empty folder or over an earlier export. "
                "Name a new folder (a folder exported by this program before exports were marked: delete it first)")
    for beside in (temporary_folder(target), _set_aside_folder(target)):
        if not _replaceable(beside):
            return (f"{beside} exists beside {named} and is not what an interrupted export leaves (an empty folder or "
                    f"one holding {EXPORT_MARKER}): an export deletes it first; move it away, or name another output "
                    "folder")
    return None


def fresh_temporary_folder(folder: str | Path) -> Path:
    """`<folder>.tmp`, empty but for EXPORT_MARKER: an earlier export that died there must not leave files in this
    one, and a leftover of this one is known as ours."""
    tmp = temporary_folder(folder)
    if not _replaceable(tmp):
        raise ExportFolderRefused(export_folder_refusal(folder))
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    (tmp / EXPORT_MARKER).write_text(_MARKER_TEXT)
    return tmp


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
                       torch.float8_e4m3fn: "F8_E4M3"}  # FP8: the block-quantized weights of an FP8 release


def write_shard(path: Path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """One safetensors file, written tensor by tensor as `tensors` yields them (in `specs`' sorted key order),
    then flushed to disk by the process that wrote it (it may be one rank of many).

    Written here rather than with safetensors.torch.save_file, which builds the whole file in memory first
    (twice the shard size at peak): the header is known from `specs`, so each tensor goes to disk as it comes
    and memory stays at one tensor. The layout is the format's own: an 8-byte little-endian header length, the
    JSON header (padded with spaces to a multiple of 8), the tensors' bytes back to back."""
    keys = sorted(specs)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key in keys:
        dtype, shape = specs[key]
        nbytes = math.prod(shape) * torch.finfo(dtype).bits // 8
        header[key] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for expected, (key, tensor) in zip(keys, tensors, strict=True):
            if key != expected or (tensor.dtype, tuple(tensor.shape)) != specs[key]:
                raise ValueError(f"{path}: got {key} {tensor.dtype} {tuple(tensor.shape)}, expected {expected} "
                                 f"{specs[expected]}")
            f.write(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())


def publish_hf_folder(tmp: Path, folder: str | Path, args: Qwen35MoeArgs, dtype: torch.dtype,
                      shards: list[list[str]], specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                      extra_files: Callable[[Path], None] | None = None) -> Path:
    """Complete a temporary folder whose shards are written (`write_hf_metadata`) and publish it (`publish_folder`)."""
    write_hf_metadata(tmp, args, dtype, shards, specs, extra_files)
    return publish_folder(tmp, folder)


def write_hf_metadata(tmp: Path, args: Qwen35MoeArgs, dtype: torch.dtype, shards: list[list[str]],
                      specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                      extra_files: Callable[[Path], None] | None = None, quantization: dict | None = None) -> None:
    """What an HF folder holds beside its shards, into `tmp` once they are written: config.json (with
    `quantization` as its quantization_config: an FP8 export's), the index (last: it names the shards) when there are
    several, then `extra_files(tmp)` (the tokenizer)."""
    dtype_name = str(dtype).removeprefix("torch.")
    config = args.to_hf_config(dtype_name) | ({"quantization_config": quantization} if quantization else {})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if len(shards) > 1:
        names = shard_names(len(shards))
        weight_map = {key: name for name, keys in zip(names, shards) for key in keys}
        index = {"metadata": {"total_size": sum(map(tensor_bytes, specs.values()))}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")  # after the shards: it names them
    if extra_files is not None:
        extra_files(tmp)


def publish_folder(tmp: Path, folder: str | Path) -> Path:
    """Make a complete temporary folder readable by all, flush it and rename it into place (`publish_folders`)."""
    return publish_folders([(tmp, folder)])[0]


def publish_folders(pairs: list[tuple[Path, str | Path]]) -> list[Path]:
    """Publish complete temporary folders as one unit (a LoRA run's merged model and its PEFT adapter): each made
    readable by all and flushed, then every folder they replace moved to `<folder>.old`, each temporary folder renamed
    into place, and the `.old` ones deleted last. A failure between the renames puts every earlier folder back (and
    leaves the temporary folders for the caller to remove): both new, or both as they were. An existing folder is
    replaced only if it is an export of this program or empty (`export_folder_refusal`, asked again here: the folder
    may have changed since the export began); ExportFolderRefused otherwise, before anything is renamed."""
    for _, folder in pairs:
        refusal = export_folder_refusal(folder)
        if refusal is not None:
            raise ExportFolderRefused(refusal)
    for tmp, _ in pairs:
        _make_readable(tmp)
        _fsync_folder(tmp)
    folders = [Path(folder).resolve() for _, folder in pairs]
    for folder in folders:
        backup = _set_aside_folder(folder)
        if backup.exists():  # left by an export that died between the renames
            shutil.rmtree(backup)
    renamed: list[tuple[Path, Path]] = []  # (from, to), to undo
    try:
        for folder in folders:
            if folder.exists():
                folder.rename(_set_aside_folder(folder))
                renamed.append((folder, _set_aside_folder(folder)))
        for (tmp, _), folder in zip(pairs, folders):
            tmp.rename(folder)
            renamed.append((tmp, folder))
    except BaseException:
        for source, target in reversed(renamed):
            target.rename(source)
        raise
    for folder in folders:
        shutil.rmtree(_set_aside_folder(folder), ignore_errors=True)
    return folders


def restore_unpublished(folder: str | Path) -> None:
    """After an export stopped midway (Ctrl-C): the folder as it was before it (an earlier export put back from
    `<folder>.old` if the stop came between publish_hf_folder's two renames), and no `<folder>.tmp`."""
    folder = Path(folder).resolve()
    backup = _set_aside_folder(folder)
    if backup.exists() and not folder.exists():
        backup.rename(folder)
    shutil.rmtree(temporary_folder(folder), ignore_errors=True)


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
