"""What the checkpoint checksums cost: a DCP save and load of a multi-GiB state, with and without them, in one
process (no process group), and the ratios.

    python benchmarks/checkpoint_integrity.py [--gib 4] [--device cpu|cuda] [--repeats 3] [--threads N]

Save variants (each into a fresh folder; the page cache as a real save leaves it):
  plain            dcp.save with DCP's FileSystemWriter: the time the others are compared with
  streamed         each file digested as DCP writes it (a writer whose streams hash what passes, inline in DCP's
                   writer thread): no second read, but no second thread either
  after, 1 thread  dcp.save, then the files read back (from the page cache) and digested by one thread
  after, N threads the same with N threads: what the trainer does (harness/checkpoint/integrity.py; N: --threads,
                   by default the trainer's, integrity.hash_threads())
Load variants: plain dcp.load; every file read back and checked by N threads, then dcp.load (the trainer's check
before a resume). The digest is integrity.py's in every variant. Each figure is the median of --repeats rounds; the
variants alternate within a round.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.checkpoint.integrity import CHUNK_BYTES, file_digest, hash_threads  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
TENSOR_MIB = 64  # a 35B-A3B layer's experts are a few hundred MiB; an optimizer state holds many such tensors


class StreamDigest:
    """integrity.file_digest's digest of the bytes written, computed as they are written."""

    def __init__(self, raw):
        self.raw, self.size, self.chunk, self.filled, self.chunks = raw, 0, hashlib.sha256(), 0, hashlib.sha256()

    def write(self, data) -> int:
        written = self.raw.write(data)
        view = memoryview(data).cast("B")
        self.size += view.nbytes
        while view.nbytes:
            take = min(view.nbytes, CHUNK_BYTES - self.filled)
            self.chunk.update(view[:take])
            self.filled, view = self.filled + take, view[take:]
            if self.filled == CHUNK_BYTES:
                self.chunks.update(self.chunk.digest())
                self.chunk, self.filled = hashlib.sha256(), 0
        return written

    def hexdigest(self) -> str:
        if self.filled or not self.size:  # the last, shorter chunk
            self.chunks.update(self.chunk.digest())
        return self.chunks.hexdigest()

    def __getattr__(self, name):  # tell, flush, fileno, close: the file's own
        return getattr(self.raw, name)


class StreamDigestFileSystem(FileSystem):
    def __init__(self):
        super().__init__()
        self.digests = {}

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as stream:
            if mode != "wb":
                yield stream
                return
            digesting = StreamDigest(stream)
            yield digesting
            self.digests[Path(path).name] = digesting.hexdigest()


def make_state(gib: float, device: str) -> dict[str, torch.Tensor]:
    count = max(1, round(gib * 1024 / TENSOR_MIB))
    numel = TENSOR_MIB * 2**20 // 4
    return {f"model.w{i}": torch.randn(numel, device=device) for i in range(count)}


def data_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.distcp")) + [folder / ".metadata"]


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="size of the state saved (fp32 tensors of 64 MiB)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=hash_threads(), help="hash threads (default: this process's)")
    parser.add_argument("--folder", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()

    work = Path(args.folder or tempfile.mkdtemp(prefix="checkpoint_integrity_"))
    work.mkdir(parents=True, exist_ok=True)
    state = make_state(args.gib, args.device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    print(f"state: {len(state)} tensors, {nbytes / 2**30:.2f} GiB on {args.device}; hash threads {args.threads}; "
          f"folder {work}")

    def fresh(name: str) -> Path:
        path = work / name
        shutil.rmtree(path, ignore_errors=True)
        return path

    def save_plain() -> None:
        path = fresh("plain")
        dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=True)

    def save_streamed() -> None:
        path = fresh("streamed")
        writer = FileSystemWriter(path)
        writer.fs = StreamDigestFileSystem()
        dcp.save(state, storage_writer=writer, no_dist=True)
        assert writer.fs.digests

    def save_after(threads: int):
        def save() -> None:
            path = fresh(f"after{threads}")
            dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=True)
            for file in data_files(path):
                file_digest(file, threads)
        return save

    target = {k: torch.empty_like(v) for k, v in state.items()}

    def load_plain() -> None:
        dcp.load(target, checkpoint_id=str(work / "plain"), no_dist=True)

    def load_verified() -> None:
        for file in data_files(work / "plain"):
            file_digest(file, args.threads)
        dcp.load(target, checkpoint_id=str(work / "plain"), no_dist=True)

    saves = {"plain": save_plain, "streamed": save_streamed, "after, 1 thread": save_after(1),
             f"after, {args.threads} threads": save_after(args.threads)}
    loads = {"plain": load_plain, f"verify ({args.threads} threads) + load": load_verified}
    times: dict[str, list[float]] = {f"save {k}": [] for k in saves} | {f"load {k}": [] for k in loads}
    save_plain()  # warm-up: allocator, page cache, DCP's first-call costs
    for _ in range(args.repeats):
        for name, fn in saves.items():
            times[f"save {name}"].append(timed(fn))
        for name, fn in loads.items():
            times[f"load {name}"].append(timed(fn))
    streamed = StreamDigestFileSystem()  # the same digests either way
    writer = FileSystemWriter(fresh("streamed"))
    writer.fs = streamed
    dcp.save(state, storage_writer=writer, no_dist=True)
    for file in sorted((work / "streamed").glob("*.distcp")):
        assert streamed.digests[file.name] == file_digest(file, args.threads)["sha256"], file
    for kind in ("save", "load"):
        base = statistics.median(times[f"{kind} plain"])
        for name, values in times.items():
            if name.startswith(kind):
                median = statistics.median(values)
                print(f"{name:34s} {median:7.2f} s  {nbytes / 2**30 / median:6.2f} GiB/s  x{median / base:.2f}")
    if args.folder is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
