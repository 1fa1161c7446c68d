"""Hugging Face weights in and out of a (possibly sharded) run, one tensor at a time.

- `load_hf_weights`: every rank plans from the checkpoint's headers (keys, shapes: cheap, and the same errors on
  every rank); rank 0 alone reads the tensors, one native tensor at a time (per-expert checkpoints fused one
  tensor at a time), and scatters it: each rank keeps its shard. Peak host memory per rank: about one tensor,
  whatever the checkpoint's size or the number of ranks.
- `export_hf` / `write_native_export` / `write_hf_folder`: the official sharded layout
  (model-0000i-of-0000n.safetensors + index, shards of at most 5 GiB planned from names and sizes alone). Shard i is
  written by rank i % W: for each of
  its tensors every rank takes part in gathering the full native tensor (once, however many HF tensors are cut
  from it: `ExportTensors`), the owner streams it into the file. Peak memory per rank: beside the model, at most
  two gathered tensors (an MTP layer's experts) on the device, one HF tensor on the host. Rank 0 then writes
  config.json, generation_config.json and the tokenizer, the index last, and renames the folder into place. The
  offline converter (harness/convert.py) writes through the same functions from a DCP checkpoint, so both give the
  same files. A LoRA model is written by its LoRA part (harness/lora/run.py) through `write_native_export`, each
  adapted weight merged as it is read.
- `write_export_folder`: the folder machinery under write_hf_folder (temporary folder, the ranks' shares, agreed
  failures, publishing), shared with the PEFT adapter export (harness/lora/peft.py); `ExportUnit`: folders
  published together.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from models.qwen35_moe import Qwen35MoeArgs, Qwen35MoeStateDictAdapter
from models.qwen35_moe.fp8_hold import dequantized, held_fp8_weights, load_held
from models.qwen35_moe.fp8_release import Fp8ReleaseTensors
from models.qwen35_moe.hf_checkpoint import (
    MAX_SHARD_BYTES,
    ExportFolderRefused,
    export_folder_refusal,
    fresh_temporary_folder,
    open_hf_tensors,
    plan_shards,
    publish_folders,
    restore_unpublished,
    shard_names,
    temporary_folder,
    write_hf_metadata,
    write_shard,
)
from models.qwen35_moe.hooks import canonical_name
from models.qwen35_moe.lora_targets import is_adapter_key
from models.qwen35_moe.state_dict_adapter import hf_export_dtype

from .errors import CheckpointError, ExportRefused, agreed
from .finite_values import all_finite, non_finite
from .fp8_export import Fp8ExportTensors

logger = logging.getLogger(__name__)


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


@torch.no_grad()
def load_hf_weights(model: nn.Module, args: Qwen35MoeArgs, path: str) -> None:
    """Set the model's weights (sharded or not) from an HF checkpoint folder, one tensor at a time."""
    rank, world = _rank_world()
    problem = None
    some = next(iter(model.parameters()))
    device = (some.to_local() if isinstance(some, DTensor) else some).device  # where an FP8 folder dequantizes
    try:  # from the headers alone: every rank reads the same, and all of them stop together
        _, read = hf_native_tensors(path, args, device)
    except (OSError, ValueError) as e:  # a damaged folder, or one of another model
        problem = f"checkpoint.initial_load_hf {path}: {e}"
    problem = agreed(problem)
    if problem is not None:
        raise CheckpointError(problem, every_rank=True)
    params = {canonical_name(name): p for name, p in model.named_parameters()
              if not is_adapter_key(name)}  # LoRA's adapters: not the base's (models/qwen35_moe/lora_targets.py)
    held = {canonical_name(name): where for name, where in held_fp8_weights(model).items()}
    stored_fp8, quantized = hf_fp8_tensors(path, args) if held else (frozenset(), None)
    if held.keys() - stored_fp8:
        raise CheckpointError(f"checkpoint.initial_load_hf {path}: the run holds {len(held)} weights in FP8 but the "
                              f"folder does not store {sorted(held.keys() - stored_fp8)[0]} quantized")
    checked = []  # (key, whether its values are all finite): rank 0 reads them
    for key, param in params.items():
        local = param.to_local() if isinstance(param, DTensor) else param
        if key in held:  # the float8 values and scales as stored, never dequantized; every rank reads them
            try:
                values, scales = quantized(key)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"checkpoint.initial_load_hf {path}: {e}") from None
            values, scales = values.to(local.device), scales.to(local.device)
            checked.append((key, all_finite(values) & all_finite(scales)))
            if isinstance(param, DTensor):  # every rank read the values: each cuts its own shard, no collective
                values = distribute_tensor(values, param.device_mesh, param.placements, src_data_rank=None).to_local()
            load_held(*held[key], local, values, scales)
            continue
        if rank == 0:
            try:
                full = read(key, param.dtype).to(local.device, param.dtype)
            except (OSError, ValueError) as e:  # the headers read, the data not: rank 0's alone
                raise CheckpointError(f"checkpoint.initial_load_hf {path}: {e}") from None
            checked.append((key, all_finite(full)))
        else:
            full = torch.empty(param.shape, dtype=param.dtype, device=local.device)
        if isinstance(param, DTensor):  # rank 0's tensor, scattered: each rank receives its own shard
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=0).to_local()
        elif world > 1:  # whole on every rank (parallel/replicated_params.py)
            dist.broadcast(full, src=0)
        local.copy_(full)
    damaged, problem = non_finite(checked), None
    if damaged:
        problem = (f"checkpoint.initial_load_hf {path}: {len(damaged)} "
                   f"{'weight holds' if len(damaged) == 1 else 'weights hold'} NaN or infinite values "
                   f"({', '.join(damaged[:3])}{', ...' if len(damaged) > 3 else ''}): the folder is damaged; "
                   "download or convert it again")
    problem = agreed(problem)
    if problem is not None:
        raise CheckpointError(problem, every_rank=True)
    logger.info("initialised weights from HF checkpoint %s", path)


def hf_native_tensors(path: str | Path, args: Qwen35MoeArgs, device: torch.device | None = None
                      ) -> tuple[dict[str, tuple[int, ...]], Callable[..., torch.Tensor]]:
    """The native tensors an HF checkpoint folder holds for a model of `args`: {key: shape}, from the file headers and
    checked against the model's (ValueError naming every difference), and the reader of one of them, whole (per-expert
    tensors fused, the fp32 contract's upcast: the state-dict adapter's `combine`). An FP8 release's weights are
    dequantized on `device` (an H100 read 35B-A3B's in 18 s, ten times the host's fp32 pass: docs/performance.md)."""
    adapter = Qwen35MoeStateDictAdapter(args)
    reader = open_hf_tensors(path)  # an FP8 release's weights dequantized on read
    if isinstance(reader, Fp8ReleaseTensors):
        logger.info("%s is an FP8 release: its %d block-wise float8 weights are read dequantized (value x block "
                    "scale, in fp32)", path, len(reader.scales))
        read_one = functools.partial(reader.read, device=device)
    else:
        read_one = reader.read
    plan = adapter.plan_from_hf(reader.keys())
    shapes = {key: _combined_shape(key, [reader.shape(h) for h in sources]) for key, sources in plan.items()}
    adapter.validate_shapes(shapes)

    def read(key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The native tensor `key`, in `dtype` if given: each HF tensor cast as it is read, before the experts are
        fused (the same numbers as a cast after; at full size a layer's fused experts in fp32 are 2 GiB)."""
        return adapter.combine(key, [read_one(h) if dtype is None else read_one(h).to(dtype) for h in plan[key]])

    return shapes, read


def hf_fp8_tensors(path: str | Path, args: Qwen35MoeArgs) -> tuple[frozenset[str], Callable[[str], tuple]]:
    """The native tensors an FP8 release folder holds quantized (every HF tensor they are made of is a float8 weight
    with block scales; none for another folder), and the reader of one as stored: (float8 values, scales), each
    fused as `combine` fuses the per-expert weights (the scales' grids stacked alike: fp8_hold.py)."""
    adapter = Qwen35MoeStateDictAdapter(args)
    reader = open_hf_tensors(path)
    if not isinstance(reader, Fp8ReleaseTensors):
        return frozenset(), None
    plan = adapter.plan_from_hf(reader.keys())
    keys = frozenset(key for key, sources in plan.items() if all(h in reader.scales for h in sources))

    def read_quantized(key: str) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [reader.read_quantized(h) for h in plan[key]]
        return tuple(adapter.combine(key, [pair[i] for pair in pairs]) for i in (0, 1))

    return keys, read_quantized


def _combined_shape(key: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape `combine` gives from tensors of these shapes (without reading them)."""
    if len(shapes) > 1 and key.endswith("experts.gate_up_proj"):
        return (len(shapes) // 2, shapes[0][0] + shapes[1][0], *shapes[0][1:])
    if len(shapes) > 1:
        return (len(shapes), *shapes[0])
    return shapes[0]


def check_hf_export_folder(folder: str | Path, source: str | Path | None = None) -> None:
    """Raise CheckpointError on every rank (train.py and the converter: exit 2, one line naming the folder and what
    to do) if an export to `folder` would be refused: it replaces only a folder that is absent, empty or an export
    of this program, never one holding or inside `source` (the checkpoint it reads), and deletes `<folder>.tmp` /
    `<folder>.old` only under the same rule (models/qwen35_moe/hf_checkpoint.py, `export_folder_refusal`).

    Called by every rank alike (a collective when distributed: rank 0 looks, every rank gets its verdict). The
    export itself calls it before anything is written; a trainer that exports at the end calls it at start, so that
    a run does not train towards an export it cannot write."""
    rank, _ = _rank_world()
    refusal = None
    if rank == 0:
        try:
            refusal = export_folder_refusal(folder, source)
        except OSError as e:  # a folder it may not list
            refusal = f"cannot look into {folder} or the folders beside it: {e}; name another output folder"
    refusal = agreed(refusal)
    if refusal is not None:
        raise ExportRefused(refusal, every_rank=True)


def write_hf_folder(folder: str | Path, args: Qwen35MoeArgs, dtype: torch.dtype,
                    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                    fetch: Callable[[list[str], bool], Iterable[tuple[str, torch.Tensor | None]]],
                    extra_files: Callable[[Path], None] | None = None,
                    max_shard_bytes: int = MAX_SHARD_BYTES, source: str | Path | None = None,
                    unit: ExportUnit | None = None, quantization: dict | None = None) -> None:
    """Write an HF folder shard by shard; called by every rank alike (`specs`: export dtype and shape of every
    HF key). `fetch(keys, keep)` yields (key, tensor) for those HF keys, in sorted order and export dtype, one at
    a time: the tensor where `keep` (the shard's owner, who writes it to disk at once), None elsewhere. It may
    run collectives: every rank consumes it whole, in the same order. `quantization`: config.json's
    quantization_config (an FP8 export's).

    `folder` is first checked (`check_hf_export_folder`, with `source` the checkpoint it is made from): a folder
    that is not an export of ours is never replaced. Everything is written into `<folder>.tmp` and renamed into
    place at the end: a write the file system refuses (a full disk) on any rank raises CheckpointError on every
    rank, the temporary folder is removed and `folder` stays as it was. With `unit`, the folder is published with the
    unit's others (`ExportUnit.publish`), not at once."""
    shards = plan_shards(specs, max_shard_bytes)
    files = {name: {k: specs[k] for k in keys} for name, keys in zip(shard_names(len(shards)), shards)}
    write_export_folder(folder, files, fetch,
                        lambda tmp: write_hf_metadata(tmp, args, dtype, shards, specs, extra_files, quantization),
                        source, unit)


def write_export_folder(folder: str | Path, files: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]],
                        fetch: Callable[[list[str], bool], Iterable[tuple[str, torch.Tensor | None]]],
                        finish: Callable[[Path], None], source: str | Path | None = None,
                        unit: ExportUnit | None = None) -> None:
    """write_hf_folder for any export folder (the PEFT adapter's too): `files`, each safetensors file's name and the
    export dtype and shape of its keys, file i written by rank i % W with `fetch` as above; then rank 0's
    `finish(tmp)` writes the other files into the temporary folder, which is published (or, with `unit`, left for
    the unit to publish with its others), with the same checks and the same failures as write_hf_folder's."""
    check_hf_export_folder(folder, source)
    rank, world = _rank_world()
    tmp = temporary_folder(folder)

    def unwritable(path: Path, e: OSError) -> tuple[str, bool]:
        """The failure as (message, whether the folder was refused: it changed since the check)."""
        if isinstance(e, ExportFolderRefused):
            return str(e), True
        return (f"cannot write the Hugging Face folder {folder}: {path}: {e}; nothing was replaced there. Free space "
                "(or fix the file system), then export again", False)

    error, tmp_is_ours = None, True
    if rank == 0:
        try:
            fresh_temporary_folder(folder)
        except OSError as e:
            error, tmp_is_ours = unwritable(tmp, e), not isinstance(e, ExportFolderRefused)
    try:
        error = _write_and_publish(folder, files, fetch, finish, tmp, error, unwritable, unit is None)
    except KeyboardInterrupt:  # a second Ctrl-C: no partial folder is left, and the earlier export stays in place
        if rank == 0 and tmp_is_ours:
            restore_unpublished(folder)
        raise
    if error is not None:
        if rank == 0 and tmp_is_ours:
            shutil.rmtree(tmp, ignore_errors=True)  # the space it took, back
        message, refused = error
        raise (ExportRefused if refused else CheckpointError)(message, every_rank=True)
    if unit is not None:
        unit.written.append((tmp, Path(folder)))


def _write_and_publish(folder, files, fetch, finish, tmp: Path, error: tuple[str, bool] | None, unwritable,
                       publish: bool) -> tuple[str, bool] | None:
    """write_export_folder's files, then rank 0's finishing and (`publish`) publishing; the failure every rank agrees
    on (None: written)."""
    rank, world = _rank_world()
    if agreed(error) is None:
        for i, (name, specs) in enumerate(files.items()):
            tensors = fetch(sorted(specs), i % world == rank)
            if i % world == rank and error is None:  # after a failed write, this rank only takes part (below)
                try:
                    write_shard(tmp / name, specs, tensors)
                except OSError as e:
                    error = unwritable(tmp / name, e)
            for _ in tensors:  # the rest, where this rank is not the owner or its write failed: every rank takes
                pass           # part in the collectives that gather each tensor
    error = agreed(error)
    if error is None and rank == 0:
        try:
            finish(tmp)
            if publish:
                publish_folders([(tmp, folder)])
        except OSError as e:
            error = unwritable(tmp, e)
    return agreed(error)


class ExportUnit:
    """Export folders published together, both new or both as they were (a LoRA run's merged model and its PEFT
    adapter): each is written whole into its temporary folder (`write_export_folder(..., unit=this)`), then
    `publish` renames them all into place at once, with SIGINT and SIGTERM held off for those renames (a Ctrl-C
    then lands just after them, as it was sent). A stop or failure before that: `discard` removes the temporary
    folders, and every earlier export stays as it was. Every rank calls `publish` and `discard` alike; rank 0 acts.
    As a context manager (`with ExportUnit() as unit:`), it publishes when the block ends and discards when it
    raises."""

    def __init__(self):
        self.written: list[tuple[Path, Path]] = []  # (temporary folder, folder), on every rank
        self.published = False

    def __enter__(self) -> ExportUnit:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.publish()
        else:
            self.discard()

    def publish(self) -> None:
        error = None
        if _rank_world()[0] == 0:
            try:
                with _signals_held():
                    publish_folders(self.written)
                    self.published = True
            except OSError as e:
                error = (f"cannot publish {' and '.join(str(f) for _, f in self.written)}: {e}; nothing was replaced "
                         "there", isinstance(e, ExportFolderRefused))
        error = agreed(error)
        if error is not None:
            self.discard()
            message, refused = error
            raise (ExportRefused if refused else CheckpointError)(message, every_rank=True)

    def discard(self) -> None:
        if _rank_world()[0] == 0 and not self.published:
            for _, folder in self.written:
                restore_unpublished(folder)


@contextmanager
def _signals_held():
    """SIGINT and SIGTERM held off for the block: received meanwhile, each is raised again, in order, once it ends.
    (Their Python handlers are swapped, not the thread's signal mask: another thread of the process, a data loader's
    or a collective's, would take a signal the main thread blocks, and Python would still run its handler at once.)"""
    if threading.current_thread() is not threading.main_thread():  # only the main thread runs signal handlers
        yield
        return
    pending: list[int] = []
    previous = {signum: signal.signal(signum, lambda received, frame: pending.append(received))
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in pending:
            signal.raise_signal(signum)


def _whole_float8(weight: torch.Tensor) -> torch.Tensor:
    """A float8 weight whole: a sharded one's shards gathered as bytes (gloo gathers no float8), a collective every
    rank joins."""
    if not isinstance(weight, DTensor):
        return weight
    raw = DTensor.from_local(weight.to_local().view(torch.uint8), weight.device_mesh, weight.placements,
                             shape=weight.shape, stride=weight.stride())
    return raw.full_tensor().view(weight.dtype)


def model_native_tensors(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], Callable[[str], torch.Tensor]]:
    """The native tensors of a (possibly sharded) model: {key: shape} and the reader of one, whole (under FSDP its
    full_tensor(), a collective every rank joins)."""
    state = {canonical_name(k): v for k, v in model.state_dict().items()}
    held = {canonical_name(name): where for name, where in held_fp8_weights(model).items()}

    def gathered(key: str) -> torch.Tensor:
        if key in held:  # a frozen FP8 base weight (fp8_hold.py), as the FP8 release's reader gives it
            module, name = held[key]
            return dequantized(module, name, torch.float32, _whole_float8(getattr(module, name)))
        tensor = state[key]
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    return {k: tuple(v.shape) for k, v in state.items()}, gathered


def write_native_export(folder: str | Path, args: Qwen35MoeArgs, dtype: torch.dtype,
                        shapes: dict[str, tuple[int, ...]], read: Callable[[str], torch.Tensor], tokenizer=None,
                        max_shard_bytes: int = MAX_SHARD_BYTES, unit: ExportUnit | None = None,
                        extra_files: Callable[[Path], None] | None = None, source: str | Path | None = None,
                        quantized: str = "none") -> None:
    """Write native tensors (`shapes`, each read whole by `read`, once, in the same order on every rank) as a Hugging
    Face folder in the official layout (write_hf_folder); `quantized` "fp8": in the FP8 release's layout instead
    (fp8_export.py). With `tokenizer` (the one the run trained with), the folder also holds its tokenizer files, and
    config.json and generation_config.json carry its BOS / EOS ids, so `AutoTokenizer` and `generate` work on it as
    it is; `extra_files` writes other files instead (the converter's)."""
    tensors = ExportTensors(Qwen35MoeStateDictAdapter(args), shapes, dtype, read)
    if quantized == "fp8":
        tensors = Fp8ExportTensors(tensors)
    if tokenizer is not None:
        args, extra_files = with_tokenizer(args, tokenizer)
    write_hf_folder(folder, args, dtype, tensors.specs, tensors.fetch, extra_files, max_shard_bytes, source, unit,
                    tensors.quantization)


def export_hf(model: nn.Module, args: Qwen35MoeArgs, folder: str, dtype: torch.dtype, tokenizer=None,
              max_shard_bytes: int = MAX_SHARD_BYTES, unit: ExportUnit | None = None, quantized: str = "none") -> None:
    """Write the (possibly sharded) model as a Hugging Face folder, every rank writing its share of the shards
    (write_native_export). A model with LoRA adapters is exported by its LoRA part instead (harness/lora/run.py:
    merged, and a PEFT adapter beside it)."""
    started = time.perf_counter()
    shapes, read = model_native_tensors(model)
    if any(map(is_adapter_key, shapes)):
        raise ValueError("a model with LoRA adapters is exported by harness/lora (LoraRun.export), merged")
    write_native_export(folder, args, dtype, shapes, read, tokenizer, max_shard_bytes, unit, quantized=quantized)
    if unit is None:  # else the unit's owner says so once the unit is published
        logger.info("exported Hugging Face checkpoint to %s in %.1f s", os.path.abspath(folder),
                    time.perf_counter() - started)


class ExportTensors:
    """An export's HF tensors, made from native tensors read one at a time: `specs` (export dtype and shape of every
    HF key) and `fetch` for `write_hf_folder`.

    `read(native_key)` gives a native tensor whole: under FSDP its full_tensor(), a collective every rank joins;
    in the converter, its bytes read from the checkpoint. It is called once per native tensor, when the first HF key
    cut from it is fetched: every rank fetches every key in the same order, so the collectives line up. The tensor
    is held until the last of its HF keys is fetched. Only an MTP layer's fused experts feed several keys, whose
    sorted names interleave (`experts.0.down_proj`, `experts.0.gate_proj`, `experts.0.up_proj`, `experts.1...`): so
    at most two native tensors are held at once, that layer's gate_up_proj and down_proj, 3 * E * I * D values
    (1.5 times the largest tensor, a main layer's gate_up_proj); on the device that gathered them in the end-of-run
    export, on the host in the converter. The shard's owner holds one HF tensor more, in the export dtype, on the
    host, until it is in the file."""

    quantization = None  # config.json's quantization_config: none (fp8_export.Fp8ExportTensors has one)

    def __init__(self, adapter: Qwen35MoeStateDictAdapter, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 read: Callable[[str], torch.Tensor]):
        self._adapter, self._read = adapter, read
        self.native_of: dict[str, str] = {}
        self.specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for key, shape in shapes.items():
            for hf_key, hf_shape in adapter.to_hf_shapes(key, shape).items():
                self.native_of[hf_key] = key
                self.specs[hf_key] = (hf_export_dtype(hf_key, dtype), hf_shape)
        self._left = Counter(self.native_of.values())  # per native tensor: its HF keys not fetched yet
        self._held: dict[str, torch.Tensor] = {}

    def value(self, hf_key: str, keep: bool = True, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """HF tensor `hf_key` in its export dtype (or `dtype`: an FP8 export quantizes from fp32), on the device its
        native tensor was read to (None unless `keep`). Every HF key is asked for once, in the same order on every
        rank."""
        key = self.native_of[hf_key]
        if key not in self._held:
            self._held[key] = self._read(key)
        native = self._held[key]
        self._left[key] -= 1
        if self._left[key] == 0:
            del self._held[key]  # not held past its last key while the shard is written
        return self._adapter.to_hf_tensor(hf_key, native).detach().to(dtype or self.specs[hf_key][0]) if keep else None

    def fetch(self, keys: list[str], keep: bool) -> Iterator[tuple[str, torch.Tensor | None]]:
        for hf_key in keys:
            hf = self.value(hf_key, keep)
            yield hf_key, None if hf is None else hf.to("cpu")


def with_tokenizer(args: Qwen35MoeArgs, tokenizer) -> tuple[Qwen35MoeArgs, Callable[[Path], None] | None]:
    """The model args with the tokenizer's BOS / EOS ids, and the writer of its files (+ generation config)."""
    if tokenizer is None:
        return args, None
    args = dataclasses.replace(args, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)

    def extra_files(tmp: Path) -> None:
        tokenizer.save_pretrained(tmp)
        generation = {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    return args, extra_files


def write_hf_meta(folder: str | Path, args: Qwen35MoeArgs, export_dtype: str,
                  extra_files: Callable[[Path], None] | None) -> None:
    """config.json (+ the tokenizer and generation config) of an export, into `folder`: what a DCP checkpoint
    keeps beside its weights so the offline converter writes the same folder as the end-of-run export."""
    folder = Path(folder)
    (folder / "config.json").write_text(json.dumps(args.to_hf_config(export_dtype), indent=2) + "\n")
    if extra_files is not None:
        extra_files(folder)
