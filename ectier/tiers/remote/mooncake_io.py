"""The transfers of one Mooncake call through registered memory: a record written from a pool
buffer, the payload's xxh3 computed while it is copied in (:func:`put_pooled`); an object read
into a pool buffer and handed out over it (:func:`read_pooled`), or into a buffer registered for
the one call (:func:`read_fresh`). Each runs on a client call thread; a buffer a failed transfer
may still use is kept by :class:`~ectier.tiers.remote.mooncake_calls.Holds`, never reused or
freed under it. Used by ``ectier/tiers/remote/mooncake.py`` only."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ...record import pack_header
from .mooncake_calls import Holds
from .mooncake_pool import BufferPool, PoolBuffer, aligned_empty, copy_hashing

__all__ = ["put_pooled", "read_pooled", "read_fresh", "NOT_FOUND", "NOT_READY", "TOO_SMALL", "NO_HANDLE", "SAFE", "LATE"]

NOT_FOUND = -704
NOT_READY = -703  # REPLICA_IS_NOT_READY: the object's put is still in flight (a miss for now)
TOO_SMALL = -600  # get_into: the object is larger than the buffer (an overwrite); put: too large
NO_HANDLE = -200  # no space (the client's transfer buffer, or the store's segments)
#: codes returned before any transfer started or after it ended: the buffer is free again
SAFE = frozenset({0, -200, -600, -703, -704, -705, -706, -900, -901})
#: put_pooled's own code: the copy ended past the caller's deadline, nothing was written
LATE = -1_000_001


def put_pooled(store: Any, pool: BufferPool, holds: Holds, name: str, header: Any, body: memoryview,
               end: float, *, hashing: bool = True) -> int | None:
    """Write the record ``header`` + ``body`` as object ``name`` from a pool buffer, with
    ``header.payload_checksum`` set to the xxh3-64 of ``body`` (``hashing``; else ``header`` is
    written as given: its checksum known to the caller): Mooncake's return code, or ``None`` when
    the pool had no room, or :data:`LATE` (nothing written) when the copy ended at or past ``end``
    (monotonic seconds, the caller's deadline): the caller may have let ``body`` change by then,
    and a checksum computed over what was copied would vouch for torn bytes."""
    nhead = len(pack_header(header))  # the checksum's value does not change the length
    buf = pool.acquire(store, nhead + len(body))
    if buf is None:
        return None
    mv = memoryview(buf.array)
    if hashing:
        header = dataclasses.replace(header, payload_checksum=copy_hashing(mv[nhead:nhead + len(body)], body))
    else:
        mv[nhead:nhead + len(body)] = body
    if time.monotonic() >= end:
        pool.give_back(buf)
        return LATE
    mv[:nhead] = pack_header(header)
    rc = store.upsert_from(name, buf.ptr, nhead + len(body))
    _end(rc, pool, holds, buf)
    return rc


def read_pooled(store: Any, pool: BufferPool, holds: Holds, name: str, buf: PoolBuffer,
                size: int) -> tuple[int, memoryview | None]:
    """``get_into`` the first ``size`` bytes of ``buf``: ``(rc, the bytes)``; the bytes are a view
    handed out over ``buf``, back in the pool when the last view of them dies."""
    rc = store.get_into(name, buf.ptr, size)
    if rc >= 0:
        return rc, buf.view(rc)
    _end(rc, pool, holds, buf)
    return rc, None


def read_fresh(store: Any, holds: Holds, name: str, size: int) -> tuple[int, memoryview | None]:
    """``get_into`` a new buffer of ``size`` bytes registered for this call: ``(rc, the bytes)``."""
    buf = aligned_empty(size)
    ptr = buf.ctypes.data
    registered = store.register_buffer(ptr, size) == 0
    rc = store.get_into(name, ptr, size)
    if rc < 0 and rc not in SAFE:
        holds.hold(rc, ptr if registered else 0, size, buf)
    elif registered:
        store.unregister_buffer(ptr)
    return rc, (memoryview(buf)[:rc] if rc >= 0 else None)


def _end(rc: int, pool: BufferPool, holds: Holds, buf: PoolBuffer) -> None:
    """End the lease of ``buf`` after a transfer that returned ``rc``."""
    if rc < 0 and rc not in SAFE:
        pool.forget(buf)  # the transfer may still use it: kept, then unregistered
        holds.hold(rc, buf.ptr, buf.capacity, buf)
    else:
        pool.give_back(buf)
