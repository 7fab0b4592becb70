"""A worker's saves, off the model step: :class:`SaveQueue`.

``save_caches`` is called on the model runner's thread right after the encoder was launched;
anything it waits for delays the step. :meth:`SaveQueue.submit` therefore never waits on I/O or a
copy, and does as little Python as it can (on a machine whose CPU caches are cold after the
encoder ran, every line the model runner's thread runs costs microseconds):

- a CUDA tensor, in-process store: ``TieredCache.put`` on the caller's thread (it only enqueues
  the copy on the cache's copy engine, after an event on the current stream, and returns a
  ``PutHandle``), polled without blocking by :meth:`SaveQueue.finished`;
- everything else (a CPU tensor in either mode; any tensor in daemon mode) goes to one background
  thread through a bounded queue (``save_queue_depth`` items): one ``deque.append``. The thread
  looks for work every ``POLL_S`` while saves come, so a save does not wake it: waking a thread
  from the model runner's thread is a system call, and on a busy machine the woken thread takes
  the caller's CPU (measured: 2 ms inside ``save_caches`` on the loaded 2-core VM). After
  ``PARK_AFTER_S`` without a save the thread sleeps until the next one wakes it. The tensor itself is
  handed over, not a copy: vLLM 0.33 never writes into an encoder output once it is in
  ``encoder_cache`` (see docs/vllm.md, "What happens on each call"). For a CUDA tensor in daemon
  mode the caller records an event on its current stream first; the thread hands the tensor and
  the event to ``DaemonClient.put(after=)``, which copies device → the daemon's shared arena
  (straight into it where the mapping is page-locked, ``cudaHostRegister``) once the encoder's
  kernels are done. The thread has its own store (a daemon client of its own), so a slow put
  never holds up the worker's loads.

The completion calls (:meth:`SaveQueue.finished`) only take the results the thread left in a
deque: no I/O, no copy, no lock; with nothing finished they return at once.

A full queue drops the save (the item is not shared; a consumer re-encodes it); so does a put
that fails (daemon down or refusing). Both are reported as save failures, and the connector
writes a rate-limited warning. A save is reported done only once the store holds it (the put
committed, or the ``PutHandle`` finished without error). :meth:`SaveQueue.close` waits for every
submitted save; one submitted while it closes is reported failed, never silently lost.

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
POLL_S = 0.001
#: ... and, after this long without one, sleeps until the next save wakes it
PARK_AFTER_S = 1.0

_NOTHING: tuple = ()  # what finished() returns when nothing finished (no list made)


class SaveQueueFullError(EctierError):
    """A save was dropped: ``save_queue_depth`` saves were already waiting for the store."""


@dataclass
class SaveResult:
    """One finished save: ``error`` is ``None`` when the store holds the item."""

    mm_hash: str
    nbytes: int
    error: BaseException | None = None


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
        self._inline = False  # the store's put only enqueues device copies (in-process)
        self._errors = errors
        self._depth = depth
        #: (mm_hash, tensor, CUDA event or None) for the thread (the caller appends, it pops)
        self._jobs: deque[tuple[str, torch.Tensor, Any]] = deque()
        self._wake = threading.Event()
        self._parked = False  # the thread sleeps until _wake
        #: finished saves not yet taken by :meth:`finished` (the thread appends; read-only outside)
        self.done: deque[SaveResult] = deque()
        #: in-process CUDA puts whose ``PutHandle`` is not yet taken (read-only outside); a caller
        #: may skip :meth:`finished` while both this and :attr:`done` are empty
        self.in_flight: list[tuple[str, int, Any]] = []
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition(threading.Lock())  # the thread notifies it per finished job
        self._submitted = 0  # jobs handed to the thread (written by the submitting thread only)
        self._finished = 0  # of those, finished (written by the put thread only, under _idle)
        self._closed = False

    # ------------------------------------------------------------------ caller's thread
    def submit(self, mm_hash: str, tensor: torch.Tensor) -> None:
        """Start saving ``tensor`` under ``mm_hash``; returns without waiting for any copy or I/O.

        ``tensor`` is kept (not copied) until its put returned: it must not be written meanwhile.

        Raises:
            SaveQueueFullError: dropped, the queue is full. EctierError: the queue is closed. The
                store's errors (in-process CUDA put).
        """
        if self._closed:
            raise EctierError("the connector is shutting down")
        if self._store is None:
            self._store = self._get_store()
            self._inline = bool(self._store.async_put)
        event = None
        if tensor.is_cuda:
            if self._inline:
                self.in_flight.append((mm_hash, tensor.nbytes, self._store.put(mm_hash, tensor)))
                return
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(tensor.device))
        jobs = self._jobs
        if len(jobs) >= self._depth:
            raise SaveQueueFullError(
                f"{self._depth} saves already wait for the store (ec_connector_extra_config."
                "save_queue_depth); this one is dropped")
        self._submitted += 1
        jobs.append((mm_hash, tensor, event))
        if self._parked:  # asleep after PARK_AFTER_S without a save (see _next)
            self._parked = False
            self._wake.set()
        elif self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ectier-saves", daemon=True)
            self._thread.start()

    def finished(self) -> "list[SaveResult] | tuple":
        """Saves finished since the last call (never blocks; no I/O, no copy, no lock)."""
        if not self.done and not self.in_flight:
            return _NOTHING
        out: list[SaveResult] = []
        if self.in_flight:
            still = []
            for mm_hash, nbytes, handle in self.in_flight:
                if not handle.done():
                    still.append((mm_hash, nbytes, handle))
                elif handle.wait(0):
                    out.append(SaveResult(mm_hash, nbytes))
                else:  # the copy failed (reported, not raised, by ectier)
                    out.append(SaveResult(mm_hash, nbytes, handle.error or EctierError("put reported failure")))
            self.in_flight = still
        done = self.done
        while done:
            out.append(done.popleft())
        return out

    def pending(self) -> int:
        """Saves submitted and not yet finished (queued, being put, or copies in flight)."""
        return self._submitted - self._finished + len(self.in_flight)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted save finished (results stay for :meth:`finished`); False on timeout."""
        for _, _, handle in list(self.in_flight):
            if not handle.wait(timeout_s) and not handle.done():
                return False
        target = self._submitted
        with self._idle:
            return self._idle.wait_for(lambda: self._finished >= target, timeout_s)

    def close(self) -> None:
        """Wait for every submitted save, then stop the thread. Idempotent. A save submitted
        while this runs is either put or reported failed (never left unreported)."""
        if self._closed:
            return
        self.wait()
        self._closed = True
        thread = self._thread
        if thread is not None:
            self._wake.set()
            thread.join()
        while self._jobs:  # submitted between the wait and the stop: reported, not lost
            mm_hash, tensor, _ = self._jobs.popleft()
            self._finish(mm_hash, tensor.nbytes, EctierError("the connector shut down before this save ran"))

    # ------------------------------------------------------------------ background thread
    def _finish(self, mm_hash: str, nbytes: int, error: BaseException | None) -> None:
        self.done.append(SaveResult(mm_hash, nbytes, error))
        with self._idle:
            self._finished += 1
            self._idle.notify_all()

    def _next(self) -> "tuple[str, torch.Tensor, Any] | None":
        """The next save, waiting for one (a look every POLL_S, asleep after PARK_AFTER_S);
        ``None`` once closed and drained."""
        jobs = self._jobs
        idle_since = time.monotonic()
        while True:
            if jobs:
                return jobs.popleft()
            if self._closed:
                return None
            if time.monotonic() - idle_since < PARK_AFTER_S:
                time.sleep(POLL_S)
                continue
            self._parked = True
            self._wake.clear()
            if jobs or self._closed:  # came in meanwhile (submit saw _parked False, or set it late)
                self._parked = False
                continue
            self._wake.wait()
            self._parked = False
            idle_since = time.monotonic()

    def _run(self) -> None:
        store = None
        while True:
            job = self._next()
            if job is None:
                break
            mm_hash, tensor, event = job
            job = None
            error: BaseException | None = None
            try:
                if store is None:
                    store = self._store.for_saves()
                error = self._put(store, mm_hash, tensor, event)
            except BaseException as exc:  # noqa: BLE001 - reported as a failed save, never raised
                error = exc.with_traceback(None)  # its frames would keep the tensor alive
            nbytes = tensor.nbytes
            tensor = event = None  # the source may be freed now
            self._finish(mm_hash, nbytes, error)
        if store is not None and store is not self._store:
            try:
                store.close()
            except self._errors:
                pass

    @staticmethod
    def _put(store: Any, mm_hash: str, tensor: torch.Tensor, event: Any) -> BaseException | None:
        if event is not None:
            handle = store.put(mm_hash, tensor, after=event)
        else:
            handle = store.put(mm_hash, tensor)
        if handle is not None and not handle.wait():  # in-process: wait for the copy here
            return handle.error or EctierError("put reported failure")
        return None
