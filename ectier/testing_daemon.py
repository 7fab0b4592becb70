"""What tests use instead of a daemon client's private state: its mapping of the daemon's arena
(map it, page-lock it, whether it is mapped).

and delays: :func:`stall_daemon_copy` and :func:`slow_daemon_reserve` delay a client's copies
and a daemon's reservations; :func:`at_prefetch_worker_unlock` and :func:`prefetch_running` stage
a daemon prefetcher's races. Like
:mod:`ectier.testing`, this module may look inside a :class:`~ectier.daemon.client.DaemonClient`
(and a :class:`~ectier.daemon.prefetch.Prefetcher`), so that tests need not.
Not for production.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    from .daemon.client import DaemonClient

__all__ = ["map_arena", "page_lock_arena", "arena_mapped", "slow_daemon_reserve", "stall_daemon_copy",
           "at_prefetch_worker_unlock", "prefetch_running"]


def map_arena(client: "DaemonClient") -> Any:
    """Map the daemon's arena into this process as ``client``'s data calls do (once: later calls
    return the same mapping) and return it: a ``torch.uint8`` tensor over the whole arena file
    named by ``client.server_info["arena"]`` (``path``, ``nbytes``). Page-locks nothing.

    Raises:
        KeyError: ``server_info`` names no arena (the client never connected).
        OSError: the arena file cannot be opened or mapped."""
    return client._arena_tensor()


def page_lock_arena(client: "DaemonClient", device: Any) -> bool:
    """What ``client`` does at its first put of a CUDA tensor on ``device``: page-lock its mapping
    of the arena (``cudaHostRegister``, under ``device``) unless that was tried already; returns
    whether the mapping is page-locked (False without CUDA, or when the registration was refused).
    Call :func:`map_arena` first."""
    return client._page_locked(device)


def arena_mapped(client: "DaemonClient") -> bool:
    """Whether ``client`` maps a daemon's arena now (from its first data call until it lets go of
    it: at close, or at the first call after its daemon went away)."""
    return client._arena_mmap is not None or client._arena is not None


@contextlib.contextmanager
def slow_daemon_reserve(server: Any, seconds: float) -> Iterator[threading.Event]:
    """Make every reservation of ``server`` (a :class:`~ectier.daemon.server.DaemonServer` in
    this process) start ``seconds`` late while the context is open, as a daemon busy making room
    would. Yields an event set once a reservation so delayed has been made (or failed)."""
    real, granted = server.cache.reserve, threading.Event()

    def late(*args, **kwargs):
        time.sleep(seconds)
        try:
            return real(*args, **kwargs)
        finally:
            granted.set()

    server.cache.reserve = late
    try:
        yield granted
    finally:
        del server.cache.reserve


@contextlib.contextmanager
def stall_daemon_copy(client: Any, seconds: float, *, times: int = 1,
                      until: Callable[[int], bool] | None = None) -> Iterator[None]:
    """Make the next ``times`` copies of ``client`` (a :class:`~ectier.daemon.client.DaemonClient`)
    into or out of the daemon's bytes (its arena, or a scratch file) start ``seconds`` late, as a
    client stalled by a GC pause, swap or ``SIGSTOP`` would, while the context is open. With
    ``until``, a stall ends as soon as ``until(n)`` is true (``n``: 1 for the first stall, then 2,
    ...; asked every 10 ms), at the latest after ``seconds``: e.g. once the daemon counted the
    lease expired, however late its reaper ran on a loaded machine."""
    real = client._bytes_of
    left = [times]

    def late(reply):
        if left[0] > 0:
            left[0] -= 1
            if until is None:
                time.sleep(seconds)
            else:
                n, deadline = times - left[0], time.monotonic() + seconds
                while not until(n) and time.monotonic() < deadline:
                    time.sleep(0.01)
        return real(reply)

    client._bytes_of = late
    try:
        yield
    finally:
        del client._bytes_of


def prefetch_running(prefetcher: Any, key: str, namespace: str | None = None) -> bool:
    """Whether a worker of ``prefetcher`` (a :class:`~ectier.daemon.prefetch.Prefetcher`) has a
    run of ``key`` (in ``namespace``, default the cache's) under way now."""
    with prefetcher._lock:
        return (prefetcher._ns(namespace), key) in prefetcher._running


class _HookedLock:
    """A lock that calls ``fn()`` after each release by a prefetch worker thread (never again from
    inside ``fn``)."""

    def __init__(self, real: Any, fn: Callable[[], None]) -> None:
        self._real, self._fn, self._inside = real, fn, threading.local()

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        return self._real.acquire(*args, **kwargs)

    def release(self) -> None:
        self._real.release()
        if threading.current_thread().name.startswith("ectier-daemon-prefetch") and \
                not getattr(self._inside, "on", False):
            self._inside.on = True
            try:
                self._fn()
            finally:
                self._inside.on = False

    def __enter__(self) -> "_HookedLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


@contextlib.contextmanager
def at_prefetch_worker_unlock(prefetcher: Any, fn: Callable[[], None]) -> Iterator[None]:
    """While the context is open, call ``fn()`` each time a worker thread of ``prefetcher`` (a
    :class:`~ectier.daemon.prefetch.Prefetcher`) lets go of its lock, right after (``fn`` may call
    the prefetcher: what a client's request could see at that instant). Open it before the
    prefetcher's first run."""
    real = prefetcher._lock
    prefetcher._lock = _HookedLock(real, fn)
    try:
        yield
    finally:
        prefetcher._lock = real
