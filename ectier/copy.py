"""Copy engines: where bytes move between the GPU, pinned host memory and the device arena.

An engine enqueues a batch of ``(dst, src)`` byte copies on a *lane* and returns a
:class:`CopyHandle` whose completion the caller can poll, wait for on the host, or make a CUDA
stream wait for. The cache never calls ``copy_`` across devices itself; it asks an engine.

::

    producer stream ──record(ready)──┐
                                     ▼ wait_event(ready)                     (rule 1)
    lane stream (d2h / h2d / arena): copy_(non_blocking) ... record(done)    (rules 2, 3: refs held,
                                                              │               record_stream)
    consumer stream ◀──wait_event(done)───────────────────────┘              (rule 4)
    host ◀── done.synchronize() in the completer thread (commit, free pinned bytes)

Engines:

- :class:`CudaCopyEngine` — one explicit ``cuda:<i>`` (rule 6); ``copy_streams`` dedicated streams
  for device-to-host (``"d2h"``), as many for host-to-device (``"h2d"``), and one ``"arena"``
  stream through which every read and write of the GPU tier's arena goes (so they are ordered
  among themselves by the GPU, without host waits). Refuses to run in a process forked after it
  was created (rule 5).
- :class:`InlineCopyEngine` — same API, copies synchronously with ``copy_`` (CPU); lets every
  piece of tier logic run on machines without CUDA.
- ``ectier.testing.DeferredCopyEngine`` — for tests: copies run only when the test says so.

:class:`Completer` runs callbacks after handles complete, in one lazily started thread.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from typing import Callable, Sequence

import torch

from .errors import EctierError, InvalidDeviceError

__all__ = [
    "LANES",
    "CopyHandle",
    "CopyEngine",
    "InlineCopyEngine",
    "CudaCopyEngine",
    "Completer",
    "copy_stream",
    "engine_for_device",
    "Engines",
]

log = logging.getLogger(__name__)

#: lanes a copy may be enqueued on: device-to-host, host-to-device, the GPU tier's arena
LANES = ("d2h", "h2d", "arena")

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]


class CopyHandle:
    """Completion of one batch of copies.

    ``done()`` polls, ``wait(timeout_s)`` blocks the host (True once complete, False on timeout;
    neither raises: a copy that failed is complete), ``error`` is the exception of a failed copy
    (``None`` while pending or on success; a CUDA error, a ``RuntimeError``, for the CUDA engine), ``wait_stream(device)`` makes
    the caller's current CUDA stream on ``device`` wait for the copies without a host sync (a no-op
    for CPU engines). The tensors of the batch are referenced until completion (rules 2 and 3).
    """

    def __init__(self, keep: Pairs | None = None) -> None:
        self.error: BaseException | None = None
        self._keep = keep
        self._event = threading.Event()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        ok = self._event.wait(timeout_s)
        return ok

    def wait_stream(self, device: torch.device) -> None:  # noqa: ARG002 - CPU engines: nothing to order
        return None

    def _finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._keep = None
        self._event.set()


class CopyEngine:
    """Base class: ``copy(pairs, lane=...) -> CopyHandle``.

    Attributes:
        device: the device whose streams the engine uses (``cpu`` for the CPU engines).
        stream_ordered: True when copies on the ``"arena"`` lane run in submission order on the
            device, so a reader enqueued after a writer always sees the writer's bytes.
    """

    device: torch.device = torch.device("cpu")
    stream_ordered = True

    def copy(self, pairs: Pairs, *, lane: str) -> CopyHandle:
        """Enqueue ``dst.copy_(src)`` for each pair (same byte length, ``uint8``) on ``lane``.

        Raises:
            ValueError: an unknown lane or pairs of different lengths (nothing enqueued).
            EctierError: the engine is used in a forked child (CUDA engine).
            RuntimeError: a copy could not be enqueued (CUDA engine); the copies of the batch
                enqueued before it have completed when this is raised (nothing in flight).
        """
        raise NotImplementedError

    @staticmethod
    def _check(pairs: Pairs, lane: str) -> None:
        if lane not in LANES:
            raise ValueError(f"lane: expected one of {LANES}, got {lane!r}")
        for dst, src in pairs:
            if dst.numel() != src.numel():
                raise ValueError(f"copy: destination of {dst.numel()} bytes, source of {src.numel()}")

    def close(self) -> None:
        """Release streams (nothing for CPU engines)."""


class InlineCopyEngine(CopyEngine):
    """Copies synchronously on the calling thread; the handle is complete on return.

    A failing ``copy_`` does not raise: the handle carries the error (like an asynchronous failure).
    """

    def copy(self, pairs: Pairs, *, lane: str) -> CopyHandle:
        self._check(pairs, lane)
        handle = CopyHandle()
        try:
            for dst, src in pairs:
                dst.copy_(src)
        except RuntimeError as exc:  # e.g. out of memory, device error
            handle._finish(exc)
            return handle
        handle._finish()
        return handle


class _CudaHandle(CopyHandle):
    """A batch's completion event. A CUDA error that surfaces when the event is queried or
    synchronized (an earlier asynchronous failure: CUDA errors are sticky) completes the handle
    with that error, as a failed copy; ``done()`` and ``wait()`` never raise it, so whoever waits
    on the batch (a put's commit, a get waiting for that put) is never left waiting for ever."""

    def __init__(self, event: "torch.cuda.Event", keep: Pairs) -> None:
        super().__init__(keep)
        self._cuda_event = event

    def done(self) -> bool:
        if self._event.is_set():
            return True
        try:
            complete = self._cuda_event.query()
        except RuntimeError as exc:  # a CUDA error, reported by the query
            self._finish(exc)
            return True
        if complete:
            self._finish()
            return True
        return False

    def wait(self, timeout_s: float | None = None) -> bool:
        if self._event.is_set():
            return True
        if timeout_s is None:
            try:
                self._cuda_event.synchronize()  # blocking-sync event: sleeps, releases the GIL
            except RuntimeError as exc:  # a CUDA error, reported by the synchronize
                self._finish(exc)
                return True
            self._finish()
            return True
        deadline = time.monotonic() + timeout_s
        pause = 20e-6
        while not self.done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 1e-3)
        return True

    def wait_stream(self, device: torch.device) -> None:
        torch.cuda.current_stream(device).wait_event(self._cuda_event)  # rule 4: no host sync


#: priority of ectier's copy streams. torch hands out the streams of one priority from a pool of
#: 32 per device, in turn; vLLM's streams (every ``torch.cuda.Stream()``) come from the default
#: priority's pool, so a copy stream of that pool could be the model's own stream (a copy, or a
#: ``synchronize``, then waits for the model's work). The high-priority pool is apart.
COPY_STREAM_PRIORITY = -1


def copy_stream(device: torch.device | str) -> "torch.cuda.Stream":
    """A CUDA stream of ``device`` for ectier's copies, from the high-priority pool
    (:data:`COPY_STREAM_PRIORITY`), never one of vLLM's default-priority streams."""
    return torch.cuda.Stream(device, priority=COPY_STREAM_PRIORITY)


class CudaCopyEngine(CopyEngine):
    """Copies on dedicated CUDA streams of one device, an event per batch.

    Args:
        device: an explicit ``cuda:<index>`` (``torch.device`` or string).
        streams_per_direction: streams in the ``"d2h"`` and in the ``"h2d"`` pool (round robin).

    Every batch: an event recorded on the caller's current stream of ``device`` (the producer) is
    waited on by the lane stream before the copies (rule 1); CUDA tensors of the batch are
    ``record_stream``-ed on the lane stream and every tensor is referenced by the handle until
    completion (rules 2, 3); the completion event can be waited on by a consumer stream
    (:meth:`CopyHandle.wait_stream`, rule 4). Host memory should be pinned for the copies to be
    asynchronous (pageable memory works, synchronously and slowly).

    Raises:
        InvalidDeviceError: ``device`` is not an existing ``cuda:<index>``.
    """

    stream_ordered = True

    def __init__(self, device: torch.device | str, *, streams_per_direction: int = 2) -> None:
        dev = torch.device(device)
        if dev.type != "cuda" or dev.index is None:
            raise InvalidDeviceError(f"device: CudaCopyEngine needs an explicit 'cuda:<index>', got {device!r}")
        if not torch.cuda.is_available() or dev.index >= torch.cuda.device_count():
            raise InvalidDeviceError(f"device: {device!r} does not exist on this machine")
        self.device = dev
        self._pid = os.getpid()
        with torch.cuda.device(dev):
            self._lanes = {
                "d2h": [copy_stream(dev) for _ in range(streams_per_direction)],
                "h2d": [copy_stream(dev) for _ in range(streams_per_direction)],
                "arena": [copy_stream(dev)],
            }
        self._next = {lane: itertools.count() for lane in LANES}

    def stream(self, lane: str, i: int = 0) -> "torch.cuda.Stream":
        """A lane's ``i``-th stream (for tests and benchmarks)."""
        return self._lanes[lane][i]

    def streams(self, lane: str) -> tuple["torch.cuda.Stream", ...]:
        """Every stream of ``lane`` (one of :data:`LANES`), in round-robin order: the copies of
        that lane are enqueued on these (``streams_per_direction`` for ``"d2h"`` and ``"h2d"``,
        one for ``"arena"``).

        Raises:
            KeyError: ``lane`` is not one of :data:`LANES`."""
        return tuple(self._lanes[lane])

    def copy(self, pairs: Pairs, *, lane: str) -> CopyHandle:
        self._check(pairs, lane)
        if os.getpid() != self._pid:
            raise EctierError(
                "CUDA copy engine used in a process forked after CUDA was initialised (docs/architecture.md, CUDA rule 5); "
                "start workers with the 'spawn' method"
            )
        streams = self._lanes[lane]
        stream = streams[next(self._next[lane]) % len(streams)]
        dev = self.device
        pairs = list(pairs)
        with torch.cuda.device(dev):
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(dev))
            stream.wait_event(ready)  # rule 1: after everything the producer enqueued so far
            try:
                with torch.cuda.stream(stream):
                    for dst, src in pairs:
                        dst.copy_(src, non_blocking=True)
            except RuntimeError:
                # the copies enqueued before the failing one still run: the caller gives their
                # blocks back (abort, unpin) and frees its tensors once this raises (rules 2, 3)
                with contextlib.suppress(RuntimeError):
                    stream.synchronize()
                raise
            for dst, src in pairs:  # rule 2: the caching allocator keeps these blocks for the lane
                for t in (dst, src):
                    if t.is_cuda:
                        t.record_stream(stream)
            done = torch.cuda.Event(blocking=True)
            done.record(stream)
        return _CudaHandle(done, pairs)  # rule 3: pinned buffers referenced until complete


def engine_for_device(device: torch.device, *, streams_per_direction: int = 2) -> CopyEngine:
    """:class:`CudaCopyEngine` for ``cuda:<i>``, :class:`InlineCopyEngine` for ``cpu``."""
    if device.type == "cuda":
        return CudaCopyEngine(device, streams_per_direction=streams_per_direction)
    return InlineCopyEngine()


class Engines:
    """How a cache reaches devices: one :class:`CudaCopyEngine` per CUDA device (created at first
    use), ``None`` (plain synchronous copies) for the CPU.

    Args:
        copy_engine: one engine for every device, CPU too (``ectier.testing`` only).
        gpu_device: a CPU stand-in for the GPU tier's device (``ectier.testing`` only: all GPU-tier
            logic then runs without CUDA). Production code sets neither.
    """

    def __init__(self, copy_engine: CopyEngine | None = None, gpu_device: str | None = None) -> None:
        self.copy_engine = copy_engine
        self.gpu_device = gpu_device
        self._engines: dict[int, CopyEngine] = {}
        self._lock = threading.Lock()

    def engine_for(self, dev: torch.device, streams: int) -> CopyEngine | None:
        """The engine for copies to or from ``dev`` (``streams`` per direction for a new CUDA one)."""
        if self.copy_engine is not None:
            return self.copy_engine
        if dev.type != "cuda":
            return None
        with self._lock:
            engine = self._engines.get(dev.index)
            if engine is None:
                engine = self._engines[dev.index] = CudaCopyEngine(dev, streams_per_direction=streams)
            return engine


class Completer:
    """Runs ``callback()`` after ``handle`` completes, in submission order, in one worker thread.

    The thread starts at the first :meth:`submit` (never in a constructor) and is a daemon thread;
    :meth:`drain` waits until every submitted callback has run; :meth:`close` drains and stops it.
    A callback that raises is logged; the others still run.
    """

    def __init__(self, name: str = "ectier-completer") -> None:
        self._name = name
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._outstanding = 0
        self._idle = threading.Condition(self._lock)
        self._pid = os.getpid()

    def submit(self, handle: CopyHandle, callback: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None or self._pid != os.getpid():
                self._pid = os.getpid()
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._outstanding += 1
        self._queue.put((handle, callback))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            handle, callback = item
            try:
                try:
                    handle.wait()
                except Exception as exc:  # noqa: BLE001 - e.g. a CUDA error surfacing at synchronize
                    handle._finish(exc)  # a copy whose completion cannot be observed has failed
                callback()
            except Exception:  # noqa: BLE001 - a failing callback must not stop the others; logged
                log.exception("copy completion callback failed")
            finally:
                with self._lock:
                    self._outstanding -= 1
                    self._idle.notify_all()

    @property
    def outstanding(self) -> int:
        with self._lock:
            return self._outstanding

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted callback ran; False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._outstanding == 0, timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        ok = self.drain(timeout_s)
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout_s)
        return ok

