"""A stream's packer run in a background thread, up to PREFETCH_BATCHES batches ahead of the training step; its state
is that of the batches consumed."""

from __future__ import annotations

import queue
import threading
import weakref
from typing import NamedTuple

import torch

from .streamed import END, StreamPacker

PREFETCH_BATCHES = 4  # hf: batches packed ahead of the training step


class _Failure(NamedTuple):
    error: BaseException


class PrefetchingLoader:
    """Runs a packer in a background thread, up to `depth` batches ahead of the consumer.

    The state is that of the batches consumed, not of those prefetched: each batch travels with the packer's
    state right after it. An exception in the thread is raised by the consumer's `next`. Loading a state stops
    the thread; the next `next` starts a fresh one.
    """

    def __init__(self, packer: StreamPacker, depth: int = PREFETCH_BATCHES):
        self.packer, self.depth = packer, depth
        self._state = packer.state_dict()  # after the last batch consumed
        self._queue: queue.Queue | None = None
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self._final = None  # END or _Failure once the thread has stopped for good

    def __iter__(self) -> PrefetchingLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._final is None and self._thread is None:
            self._start()
        item = self._final if self._final is not None else self._queue.get()
        if item is END or isinstance(item, _Failure):
            self._final = item
            if item is END:
                raise StopIteration
            raise item.error
        batch, self._state = item
        return batch

    def _start(self) -> None:
        self._queue, self._stop = queue.Queue(maxsize=self.depth), threading.Event()
        self._thread = threading.Thread(target=_produce, args=(self.packer, self._queue, self._stop), daemon=True,
                                        name=f"data-prefetch-dp{self.packer.dp_rank}")
        weakref.finalize(self, self._stop.set)  # a dropped loader lets its thread end
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (it ends at its next batch boundary); a later `next` goes on from the last batch
        consumed, so the prefetched batches are packed again rather than lost."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._queue = self._stop = self._thread = None
            self.packer.load_state_dict(self._state)

    def state_dict(self) -> dict:
        return {key: list(value) if isinstance(value, list) else value for key, value in self._state.items()}

    def load_state_dict(self, sd: dict) -> None:
        self.close()  # the thread owns the packer while it runs
        self.packer.load_state_dict(sd)
        self._state, self._final = self.packer.state_dict(), None


def _produce(packer: StreamPacker, out: queue.Queue, stop: threading.Event) -> None:
    try:
        while not stop.is_set():
            batch = packer.next_batch()
            if not _put(out, (batch, packer.state_dict()), stop):
                return
    except StopIteration:
        _put(out, END, stop)
    except BaseException as e:  # handed to the consumer, which raises it
        _put(out, _Failure(e), stop)


def _put(out: queue.Queue, item, stop: threading.Event) -> bool:
    while not stop.is_set():  # a timeout, so that a stopped loader's thread does not block on a full queue
        try:
            out.put(item, timeout=0.1)
            return True
        except queue.Full:
            pass
    return False
