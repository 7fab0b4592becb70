"""Registered memory for the Mooncake backend, registered once and reused (:class:`BufferPool`),
and the copy of a record's payload into it that computes the payload's xxh3 on the way
(:func:`copy_hashing`). Used by ``ectier/tiers/remote/mooncake.py`` only.

Why a pool: registering a buffer with the client costs ~1 ms per call (register + unregister) and
a fresh buffer costs its page faults on the first transfer into it; ``raw registered`` in
docs/benchmarks.md ("Remote tier: Mooncake Store") shows the headroom. Why not Mooncake's own
``mooncake.store.BufferPool`` (0.3.13): measured, it raises a ``max_bytes`` below the client's
local buffer to that buffer's size, and it does not say whether a lease can lie inside the
client's own buffer, which the client frees at ``close`` — a tensor handed out over it could
outlive it.

Every buffer starts on a page boundary: measured on the development machine (AMD EPYC, TCP
transport), a transfer into a buffer at 16 bytes past a page boundary — where numpy's
``np.empty`` of a few MiB lands — took 1.4x the CPU time of one into an aligned buffer.

Every buffer is a numpy array owned by Python: a get's buffer is handed out as a memoryview
(:meth:`PoolBuffer.view`) whose last reference returns it to the pool, from any thread (a
finalizer: it only appends to a :class:`queue.SimpleQueue`; the pool takes the returns under its
lock at its next call). So a buffer is never reused while anything over it lives, and its memory
is freed only with the last view of it, even after the pool closed.

The bound: the bytes of every buffer the pool holds — free, leased, or handed out — stay within
``limit_bytes`` (``remote.mooncake_buffer_pool_bytes``). A request that does not fit once free
buffers were dropped gets ``None``: the caller uses memory registered for the one call instead.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import xxhash

__all__ = ["BufferPool", "PoolBuffer", "aligned_empty", "copy_hashing", "capacity_for", "MIN_BUFFER_BYTES",
           "HASH_CHUNK_BYTES", "PAGE_BYTES", "SizeHints"]

log = logging.getLogger("ectier.tiers.remote.mooncake")

#: the smallest buffer the pool makes (bytes); requests are rounded up to a capacity class
MIN_BUFFER_BYTES = 1 << 20
#: the payload is copied and hashed in pieces of this size (bytes; each hashed while it is in cache)
HASH_CHUNK_BYTES = 1 << 20
#: buffers start on a page boundary
PAGE_BYTES = 4096


def capacity_for(nbytes: int) -> int:
    """The capacity class of a request of ``nbytes`` (> 0) bytes: at least
    :data:`MIN_BUFFER_BYTES`, rounded up to an eighth of its power of two (at most 12.5 % unused)."""
    if nbytes <= MIN_BUFFER_BYTES:
        return MIN_BUFFER_BYTES
    step = 1 << max(0, nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


def aligned_empty(nbytes: int) -> np.ndarray:
    """A new ``uint8`` array of ``nbytes`` bytes starting on a page boundary (not zero-filled)."""
    whole = np.empty(nbytes + PAGE_BYTES, dtype=np.uint8)
    start = -int(whole.ctypes.data) % PAGE_BYTES
    return whole[start:start + nbytes]


def copy_hashing(dst: memoryview, src: memoryview) -> int:
    """Copy ``src`` into ``dst`` (both 1-D byte views of the same length) and return the xxh3-64
    of the bytes, hashing each piece of :data:`HASH_CHUNK_BYTES` right after copying it."""
    n = len(src)
    if len(dst) != n:
        raise ValueError(f"copy_hashing: {len(dst)} bytes of room for {n} bytes")
    h = xxhash.xxh3_64()
    for at in range(0, n, HASH_CHUNK_BYTES):
        piece = dst[at:at + HASH_CHUNK_BYTES]
        piece[:] = src[at:at + HASH_CHUNK_BYTES]
        h.update(piece)
    return h.intdigest()


class PoolBuffer:
    """One registered buffer of ``capacity`` bytes (``array``: its numpy ``uint8`` array; ``ptr``:
    its address), leased to one call at a time."""

    __slots__ = ("array", "ptr", "capacity", "_pool")

    def __init__(self, pool: "BufferPool", capacity: int) -> None:
        self.array = aligned_empty(capacity)  # measured faster than np.empty's (module docstring)
        self.ptr = int(self.array.ctypes.data)
        self.capacity = capacity
        self._pool = pool

    def view(self, nbytes: int) -> memoryview:
        """A writable memoryview of the first ``nbytes`` bytes; the buffer goes back to the pool
        when the last reference to it (or to anything made from it: slices, tensors) is gone.
        Call once per lease, instead of :meth:`BufferPool.give_back`."""
        return memoryview(np.asarray(_Handout(self, nbytes)))


class _Handout:
    """The bytes of a handed-out buffer, for numpy (``__array_interface__``); returns the buffer
    to its pool when numpy's array over it, and so every view of that, is freed."""

    __slots__ = ("__array_interface__", "_buf")

    def __init__(self, buf: PoolBuffer, nbytes: int) -> None:
        self.__array_interface__ = {"data": (buf.ptr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}
        self._buf = buf

    def __del__(self) -> None:
        buf, self._buf = self._buf, None
        if buf is not None:
            buf._pool._returned.put(buf)  # SimpleQueue.put: safe in a finalizer, on any thread


class BufferPool:
    """Buffers registered with a Mooncake client once, reused, within ``limit_bytes`` in all.

    Args:
        limit_bytes: the most bytes of buffers held at once (free, leased or handed out); > 0.

    Methods that register or unregister take the client (``store``) and may block: call them on a
    client call thread. Thread-safe.
    """

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes: expected bytes > 0, got {limit_bytes!r}")
        self.limit_bytes = int(limit_bytes)
        self._lock = threading.Lock()
        self._free: list[PoolBuffer] = []  # least recently returned first
        self._returned: queue.SimpleQueue = queue.SimpleQueue()
        self._held = 0  # bytes of every buffer of the pool
        self._out = 0  # bytes of buffers leased or handed out
        self._closed = False
        self.reuses = 0  # leases served by a buffer registered before
        self.registrations = 0  # buffers registered
        self.refusals = 0  # requests that did not fit (the caller registered for the one call)

    def acquire(self, store: Any, nbytes: int) -> PoolBuffer | None:
        """A buffer of at least ``nbytes`` (> 0) bytes, registered with ``store``, leased to the
        caller (end the lease with :meth:`give_back`, :meth:`forget` or :meth:`PoolBuffer.view`);
        ``None`` when it cannot be had within ``limit_bytes`` or registration failed."""
        want = capacity_for(nbytes)
        drop: list[PoolBuffer] = []
        with self._lock:
            self._take_returns()
            if self._closed or want > self.limit_bytes:
                self.refusals += 1
                return None
            fit = [b for b in self._free if nbytes <= b.capacity <= want + (want >> 2)]
            if fit:
                buf = min(fit, key=lambda b: b.capacity)
                self._free.remove(buf)
                self._out += buf.capacity
                self.reuses += 1
                return buf
            while self._held + want > self.limit_bytes and self._free:
                victim = self._free.pop(0)
                self._held -= victim.capacity
                drop.append(victim)
            if self._held + want > self.limit_bytes:
                self.refusals += 1
                self._free.extend(drop)  # nothing gained: keep them
                self._held += sum(b.capacity for b in drop)
                return None
            self._held += want
            self._out += want
        for victim in drop:
            store.unregister_buffer(victim.ptr)
        try:
            buf = PoolBuffer(self, want)
            ok = store.register_buffer(buf.ptr, want) == 0
        except MemoryError:
            ok = False
        if not ok:
            with self._lock:
                self._held -= want
                self._out -= want
                self.refusals += 1
            return None
        with self._lock:
            self.registrations += 1
        return buf

    def give_back(self, buf: PoolBuffer) -> None:
        """End a lease whose buffer no transfer uses any more (it may be leased again)."""
        self._returned.put(buf)

    def forget(self, buf: PoolBuffer) -> None:
        """End a lease whose buffer a failed transfer may still use: the pool drops it (the
        caller keeps it, and unregisters it, when that is safe)."""
        with self._lock:
            self._held -= buf.capacity
            self._out -= buf.capacity

    def _take_returns(self) -> None:  # under the lock
        while True:
            try:
                buf = self._returned.get_nowait()
            except queue.Empty:
                return
            self._out -= buf.capacity
            if self._closed:
                self._held -= buf.capacity
            else:
                self._free.append(buf)

    def describe(self) -> dict[str, int]:
        """``limit_bytes``, ``held_bytes`` (every buffer of the pool), ``out_bytes`` (leased or
        handed out), ``registrations``, ``reuses``, ``refusals``."""
        with self._lock:
            self._take_returns()
            return {"limit_bytes": self.limit_bytes, "held_bytes": self._held, "out_bytes": self._out,
                    "registrations": self.registrations, "reuses": self.reuses, "refusals": self.refusals}

    def close(self, store: Any | None) -> None:
        """Drop the free buffers (unregistered from ``store`` unless None) and refuse new leases;
        buffers still handed out are freed with their last view. Idempotent."""
        with self._lock:
            self._take_returns()
            self._closed = True
            free, self._free = self._free, []
            self._held -= sum(b.capacity for b in free)
        if store is not None:
            for buf in free:
                try:
                    store.unregister_buffer(buf.ptr)
                except Exception as exc:  # noqa: BLE001 - closing: nothing to hand it to
                    log.debug("mooncake: unregister at close: %s", exc)


class SizeHints:
    """The size of the objects this backend wrote or read last (at most ``limit`` names, the
    least recently used forgotten first), so that a get of one needs no ``get_size`` first: it
    reads into a buffer of that size's capacity class, and only an object grown past it costs the
    ``get_size`` after all. Thread-safe."""

    def __init__(self, limit: int = 4096) -> None:
        self._limit = limit
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, name: str) -> int | None:
        """The size last noted for ``name`` (bytes), or None."""
        with self._lock:
            size = self._sizes.get(name)
            if size is not None:
                self._sizes.move_to_end(name)
            return size

    def note(self, name: str, nbytes: int) -> None:
        """``name`` holds ``nbytes`` (> 0) bytes now."""
        with self._lock:
            self._sizes[name] = nbytes
            self._sizes.move_to_end(name)
            while len(self._sizes) > self._limit:
                self._sizes.popitem(last=False)

    def drop(self, name: str) -> None:
        """Forget ``name`` (deleted, or not found)."""
        with self._lock:
            self._sizes.pop(name, None)
