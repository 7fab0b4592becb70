"""What tests use for the remote tier and several nodes: a remote store in this process's memory
(:class:`MemoryBackend`) and write versions stamped as by a node whose clock runs ahead
(:func:`versions_from_another_clock`). Both re-exported by :mod:`ectier.testing`. Not for
production.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from .tiers.remote.backend import RemoteBackend, RemoteTimeout

__all__ = ["MemoryBackend", "versions_from_another_clock"]


@contextlib.contextmanager
def versions_from_another_clock(ahead_s: float) -> Iterator[None]:
    """Inside: write versions are stamped as on a machine whose clock runs ``ahead_s`` seconds
    ahead of this one; after: this process's version counter is back where it was, as if those
    stamps had been made elsewhere (two nodes with skewed clocks, in one process)."""
    from . import entry
    import time as _time

    class _Clock:
        @staticmethod
        def time_ns() -> int:
            return _time.time_ns() + int(ahead_s * 1e9)

    with entry._version_lock:
        saved = entry._last_version
    entry.time = _Clock
    try:
        yield
    finally:
        entry.time = _time
        with entry._version_lock:
            entry._last_version = saved


class MemoryBackend(RemoteBackend):
    """A remote store in this process's memory (a dict), shared by every cache given the same
    instance — two caches on one backend stand for two nodes on one store. ``fail_with`` makes
    every call raise that error while set; ``delay_s`` makes every call take that long first
    (a call whose delay passes its deadline raises :class:`RemoteTimeout`)."""

    name = "memory"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.calls: list[str] = []
        self.fail_with: BaseException | None = None
        self.delay_s = 0.0
        self._lock = threading.Lock()

    def _enter(self, op: str, deadline_s: float) -> None:
        self.calls.append(op)
        if self.delay_s:
            import time

            time.sleep(min(self.delay_s, deadline_s))
            if self.delay_s >= deadline_s:
                raise RemoteTimeout(f"{op}: no answer within {deadline_s} s")
        if self.fail_with is not None:
            raise self.fail_with

    def put(self, key, data, *, deadline_s):
        self._enter("put", deadline_s)
        with self._lock:
            self.objects[key] = bytes(data)

    def get(self, key, *, deadline_s):
        self._enter("get", deadline_s)
        with self._lock:
            return self.objects.get(key)

    def exists(self, key, *, deadline_s):
        self._enter("exists", deadline_s)
        with self._lock:
            return key in self.objects

    def delete(self, key, *, deadline_s):
        self._enter("delete", deadline_s)
        with self._lock:
            self.objects.pop(key, None)
