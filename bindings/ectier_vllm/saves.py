"""A worker's saves, off the model step: :class:`SaveQueue`.

``save_caches`` is called on the model runner's thread right after the encoder was launched;
anything it waits for delays the step. :meth:`SaveQueue.submit` therefore never waits on I/O:

- a CUDA tensor, in-process store: ``TieredCache.put`` on the caller's thread (it only enqueues
  the copy on the cache's copy engine, after an event on the current stream, and returns a
  ``PutHandle``), polled without blocking by :meth:`SaveQueue.finished`;
- everything else (a CPU tensor in either mode; any tensor in daemon mode) goes to one background
  thread through a bounded queue (``save_queue_depth`` items). The thread looks for work every
  ``POLL_S`` while saves come, so a save does not wake it (waking a thread makes the caller hand
  CPython's GIL over); after ``PARK_AFTER_S`` without one it sleeps until the next save. For a CUDA tensor in daemon mode
  the caller records an event on its current stream first; the thread hands the tensor and the
  event to ``DaemonClient.put(after=)``, which copies device → the daemon's shared arena (straight
  into it where the mapping is page-locked, ``cudaHostRegister``) once the encoder's kernels are
  done. The thread has its own store (a daemon client of its own), so a slow put never holds up
  the worker's loads.

A full queue drops the save (the item is not shared; a consumer re-encodes it); so does a put
that fails (daemon down or refusing). Both are reported as save failures, and the connector
writes a rate-limited warning. A save is reported done only once the store holds it (the put
committed, or the ``PutHandle`` finished without error). :meth:`SaveQueue.close` waits for every
submitted save.

The queue holds a reference to each tensor until its put returned: up to ``save_queue_depth``
encoder outputs (e.g. 32 MiB each for ``(2040, 8192)`` bf16) beyond what vLLM's encoder cache
holds, on the worker's device in daemon mode.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ectier.errors import EctierError

#: items a worker may have waiting for the background put thread before new saves are dropped
DEFAULT_SAVE_QUEUE_DEPTH = 16
#: the put thread looks for new saves this often (seconds) while saves keep coming ...
POLL_S = 0.002
#: ... and, after this long without one, sleeps until the next save wakes it. Waking a thread
#: costs the caller about 50-150 us (CPython hands it the GIL); a look costs it nothing
PARK_AFTER_S = 1.0


class SaveQueueFullError(EctierError):
    """A save was dropped: ``save_queue_depth`` saves were already waiting for the store."""


@dataclass
class SaveResult:
    """One finished save: ``error`` is ``None`` when the store holds the item."""

    mm_hash: str
    nbytes: int
    error: BaseException | None = None


@dataclass
class _Job:
    mm_hash: str
    nbytes: int
    tensor: torch.Tensor
    event: Any = None  # CUDA event recorded on the caller's stream after the encoder's kernels




class SaveQueue:
    """Saves of one worker connector (see module docstring).

    Args:
        get_store: returns the connector's store (an ``InProcessStore``: ``put`` → ``PutHandle``),
            called at the first save; the background thread puts through its ``for_saves()``
            (daemon mode: a ``DaemonStore`` with a client of its own; in-process: the store itself).
        depth: saves that may wait for the thread (int >= 1).
        errors: exception types a put may raise that make it a failed save (others propagate in
            the thread and are reported as failures too, never raised into the worker).

    Raises:
        ValueError: ``depth`` below 1.
    """

    def __init__(self, get_store: Callable[[], Any], *, depth: int = DEFAULT_SAVE_QUEUE_DEPTH,
                 errors: tuple[type[BaseException], ...] = (EctierError, OSError, RuntimeError)) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"save_queue_depth: expected an int >= 1, got {depth!r}")
        self._get_store = get_store
        self._store: Any = None  # the connector's store, from the first save on
        self._errors = errors
        self._depth = depth
        self._jobs: deque[_Job] = deque()  # guarded by _lock
        self._wake = threading.Event()
        self._parked = False  # the thread sleeps until _wake (guarded by _lock)
        self._done: deque[SaveResult] = deque()
        self._handles: list[tuple[str, int, Any]] = []  # in-process CUDA puts: PutHandles in flight
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queued = 0  # jobs submitted to the thread and not yet finished
        self._closed = False

    # ------------------------------------------------------------------ caller's thread
    def submit(self, mm_hash: str, tensor: torch.Tensor) -> None:
        """Start saving ``tensor`` under ``mm_hash``; returns without waiting for any copy or I/O.

        Raises:
            SaveQueueFullError: dropped, the queue is full. The store's errors (in-process CUDA put).
        """
        nbytes = tensor.numel() * tensor.element_size()
        if self._store is None:
            self._store = self._get_store()
        if tensor.device.type == "cuda" and self._store.async_put:
            self._handles.append((mm_hash, nbytes, self._store.put(mm_hash, tensor)))
            return
        event = None
        if tensor.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensor.device))
        with self._lock:
            if self._closed:
                raise EctierError("the connector is shutting down")
            if len(self._jobs) >= self._depth:
                raise SaveQueueFullError(
                    f"{self._depth} saves already wait for the store (ec_connector_extra_config."
                    "save_queue_depth); this one is dropped")
            self._jobs.append(_Job(mm_hash, nbytes, tensor, event))
            self._queued += 1
            wake, self._parked = self._parked, False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ectier-saves", daemon=True)
                self._thread.start()
        if wake:
            self._wake.set()

    def finished(self) -> list[SaveResult]:
        """Saves finished since the last call (never blocks)."""
        out: list[SaveResult] = []
        still = []
        for mm_hash, nbytes, handle in self._handles:
            if not handle.done():
                still.append((mm_hash, nbytes, handle))
            elif handle.wait(0):
                out.append(SaveResult(mm_hash, nbytes))
            else:  # the copy failed (reported, not raised, by ectier)
                out.append(SaveResult(mm_hash, nbytes, handle.error or EctierError("put reported failure")))
        self._handles = still
        while self._done:
            out.append(self._done.popleft())
        return out

    def pending(self) -> int:
        """Saves submitted and not yet finished (queued, being put, or copies in flight)."""
        with self._lock:
            return self._queued + len(self._handles)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted save finished (results stay for :meth:`finished`); False on timeout."""
        for _, _, handle in list(self._handles):
            if not handle.wait(timeout_s) and not handle.done():
                return False
        with self._idle:
            return self._idle.wait_for(lambda: self._queued == 0, timeout_s)

    def close(self) -> None:
        """Wait for every submitted save, then stop the thread. Idempotent."""
        self.wait()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._wake.set()
            thread.join()

    # ------------------------------------------------------------------ background thread
    def _next(self) -> "_Job | None":
        """The next save, waiting for one (a look every POLL_S, asleep after PARK_AFTER_S);
        ``None`` once closed and drained."""
        idle_since = time.monotonic()
        while True:
            with self._lock:
                if self._jobs:
                    return self._jobs.popleft()
                if self._closed:
                    return None
                park = time.monotonic() - idle_since >= PARK_AFTER_S
                if park:
                    self._parked = True
                    self._wake.clear()
            if park:
                self._wake.wait()
                idle_since = time.monotonic()
            else:
                time.sleep(POLL_S)

    def _run(self) -> None:
        store = None
        while True:
            job = self._next()
            if job is None:
                break
            error: BaseException | None = None
            try:
                if store is None:
                    store = self._store.for_saves()
                error = self._put(store, job)
            except BaseException as exc:  # noqa: BLE001 - reported as a failed save, never raised
                error = exc
            self._done.append(SaveResult(job.mm_hash, job.nbytes, error))
            job.tensor = job.event = None  # the source may be freed now
            with self._idle:
                self._queued -= 1
                self._idle.notify_all()
        if store is not None and store is not self._store:
            try:
                store.close()
            except self._errors:
                pass

    def _put(self, store: Any, job: _Job) -> BaseException | None:
        if job.event is not None:
            handle = store.put(job.mm_hash, job.tensor, after=job.event)
        else:
            handle = store.put(job.mm_hash, job.tensor)
        if handle is not None and not handle.wait():  # in-process: wait for the copy here
            return handle.error or EctierError("put reported failure")
        return None
