"""The daemon's leases: one per reservation (``put``) or read pin (``get``) a client holds.

A lease belongs to one connection and has a deadline (monotonic seconds, ``daemon.lease_s`` after
it was granted), except a *process-held* read lease (``pid`` set; the pin under a client's
zero-copy view, :mod:`ectier.daemon.holders`): it belongs to the client process, has no deadline,
survives its connections, and is released by any connection of that process or when the process
dies. :class:`LeaseBook` keeps the live ones by id; :func:`end_lease` ends one on the
cache (commit or abort a reservation, release a pin). Who ends which lease when (disconnect,
expiry, shutdown) is the server's business (:mod:`ectier.daemon.server`).

A put reservation that ends without a commit while its client process lives on (its deadline
passed, or its connection closed) becomes an *orphan*: its blocks stay reserved, so no other entry
is written into them while the process may still be copying into its writable mapping of the
arena (a stalled client resuming after ``daemon.lease_s`` would otherwise overwrite another
entry's bytes). An orphan ends, and its blocks return, when the process says it is done (an
``abort`` naming the lease and this daemon run, from any of its connections) or exits. A client
that says ``bye`` on a connection writes into none of its reservations any more: they end at its
close instead (an orphan comes only from a closed connection: expiry closes it).

Locking: the book is guarded by the server's lock, which also guards the connections, so that a
connection's lease set and the book change together. :meth:`LeaseBook.grant`,
:meth:`LeaseBook.take` and :meth:`LeaseBook.take_all` take that lock; the methods named
``*_locked`` expect the caller to hold it.

Arena bytes: an entry occupies whole ``host.block_bytes`` blocks of the arena however small it
is, so what a lease pins (and what the caps on pins count: ``daemon.view_pin_bytes``,
``daemon.view_pin_total_bytes``, the prefetcher's held pins) is :func:`arena_footprint` of its
``nbytes``, ``ceil(nbytes / block_bytes) * block_bytes``, never ``nbytes`` itself.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ..cache import ReadLease, TieredCache, WriteLease
from ..errors import EctierError
from .connections import Connection
from .scratch import DirectPut, DirectRead

__all__ = ["Lease", "LeaseBook", "arena_footprint", "end_lease", "place_of"]

log = logging.getLogger("ectier.daemon")


def arena_footprint(nbytes: int, block_bytes: int) -> int:
    """Bytes of the host arena an entry of ``nbytes`` occupies: its whole blocks."""
    return -(-nbytes // block_bytes) * block_bytes


@dataclass(eq=False)
class Lease:
    """One lease: ``kind`` is ``"put"`` (``handle`` a :class:`WriteLease`, or a
    :class:`~ectier.daemon.scratch.DirectPut` through a scratch file) or ``"get"`` (a
    :class:`ReadLease`, or a :class:`~ectier.daemon.scratch.DirectRead`); ``deadline`` is in
    :func:`time.monotonic` seconds."""

    id: int
    kind: str  # "put" | "get"
    conn: Connection | None  # None for a process-held lease
    deadline: float
    handle: WriteLease | ReadLease | DirectPut | DirectRead
    pid: int | None = None  # the holding process of a process-held lease
    place: tuple | None = None  # a process-held lease's arena place (:func:`place_of`)

    @property
    def arena_nbytes(self) -> int:
        """Entry bytes this lease holds in the host arena (0 for a scratch file); it occupies
        :func:`arena_footprint` of them (whole blocks)."""
        return self.handle.meta.nbytes if isinstance(self.handle, (WriteLease, ReadLease)) else 0


class LeaseBook:
    """The live leases by id (see the module docstring for the locking).

    Args:
        lock: the server's lock.
        lease_s: seconds from grant to deadline (``daemon.lease_s``).
        new_id_locked: returns a fresh id, called with ``lock`` held (the server's counter, shared
            with connection ids, so that an id names one thing).
        block_bytes: ``host.block_bytes``: process-held leases are counted in whole blocks.
    """

    def __init__(self, lock: threading.Lock, lease_s: float, new_id_locked: Callable[[], int], *,
                 block_bytes: int) -> None:
        self._lock = lock
        self.block_bytes = block_bytes
        self._lease_s = lease_s
        self._new_id_locked = new_id_locked
        self._by_id: dict[int, Lease] = {}
        # pid -> {arena place of an entry: [process-held leases on it, its arena bytes]}: what a
        # process pins through views, each entry counted once (kept as leases come and go)
        self._held: dict[int, dict[tuple, list[int]]] = {}
        self._held_bytes: dict[int, int] = {}  # pid -> the arena bytes of its places (kept with _held)
        #: arena bytes (whole blocks) pinned through views, summed over the processes (an entry
        #: that two processes view counts twice)
        self.held_total = 0
        self._orphans: dict[int, Lease] = {}  # id -> put lease ended uncommitted, its process alive

    def __len__(self) -> int:
        return len(self._by_id)

    def grant(self, conn: Connection, kind: str, handle: WriteLease | ReadLease | DirectPut | DirectRead) -> int:
        """Record a new lease of ``conn``; returns its id."""
        with self._lock:
            lease = Lease(self._new_id_locked(), kind, conn, time.monotonic() + self._lease_s, handle)
            self._by_id[lease.id] = lease
            conn.leases.add(lease.id)
        return lease.id

    def grant_held_locked(self, pid: int, handle: ReadLease, place: tuple | None = None) -> int:
        """Record a process-held read lease of process ``pid`` (no deadline) on ``handle``, whose
        :func:`place_of` is ``place`` (computed when ``None``); returns its id."""
        place = place_of(handle) if place is None else place
        lease = Lease(self._new_id_locked(), "get", None, float("inf"), handle, pid, place)
        self._by_id[lease.id] = lease
        places = self._held.setdefault(pid, {})
        slot = places.get(place)
        if slot is None:
            nbytes = arena_footprint(handle.meta.nbytes, self.block_bytes)
            places[place] = [1, nbytes]
            self._held_bytes[pid] = self._held_bytes.get(pid, 0) + nbytes
            self.held_total += nbytes
        else:
            slot[0] += 1
        return lease.id

    def _forget_held_locked(self, lease: Lease) -> None:
        places = self._held.get(lease.pid)
        slot = places.get(lease.place) if places is not None else None
        if slot is None:
            return
        slot[0] -= 1
        if slot[0] <= 0:
            del places[lease.place]
            self._held_bytes[lease.pid] -= slot[1]
            self.held_total -= slot[1]
            if not places:
                del self._held[lease.pid]
                del self._held_bytes[lease.pid]

    def take(self, conn: Connection, lease_id: int, kind: str) -> Lease | None:
        """Remove and return lease ``lease_id`` if it is ``conn``'s (or, process-held, its
        process's) and of ``kind``; else None (unknown, expired, another client's, the other kind)."""
        with self._lock:
            return self._take_locked(conn, lease_id, kind)

    def take_many(self, conn: Connection, lease_ids: list[int], kind: str) -> list[Lease]:
        """:meth:`take` of each of ``lease_ids`` under one acquisition of the lock; the leases
        found (unknown ones are left out)."""
        with self._lock:
            return [l for i in lease_ids if (l := self._take_locked(conn, i, kind)) is not None]

    def _take_locked(self, conn: Connection, lease_id: int, kind: str) -> Lease | None:
        lease = self._by_id.get(lease_id)
        if lease is None or lease.kind != kind:
            return None
        if (lease.pid != conn.pid) if lease.conn is None else (lease.conn is not conn):
            return None
        del self._by_id[lease_id]
        if lease.conn is not None:
            conn.leases.discard(lease_id)
        else:
            self._forget_held_locked(lease)
        return lease

    def take_held_of_locked(self, pid: int) -> list[Lease]:
        """Remove and return every process-held lease of process ``pid`` (it died)."""
        mine = [l for l in self._by_id.values() if l.conn is None and l.pid == pid]
        for lease in mine:
            del self._by_id[lease.id]
        self._held.pop(pid, None)
        self.held_total -= self._held_bytes.pop(pid, 0)
        return mine

    def held_bytes_locked(self, pid: int, also: ReadLease | None = None, place: tuple | None = None) -> int:
        """Host-arena bytes (whole blocks, :func:`arena_footprint`) the process-held leases of
        ``pid`` pin (and ``also``, whose :func:`place_of` is ``place``, would): each entry counted
        once, however many leases of the process pin it (e.g. the scheduler's pin and the
        worker's view of one item)."""
        total = self._held_bytes.get(pid, 0)
        if also is not None and (place_of(also) if place is None else place) not in self._held.get(pid, {}):
            total += arena_footprint(also.meta.nbytes, self.block_bytes)
        return total

    def held_pids_locked(self) -> set[int]:
        """Processes holding at least one process-held lease."""
        return set(self._held)

    # ----------------------------------------------------------------------- orphaned puts

    @staticmethod
    def may_be_written(lease: Lease) -> bool:
        """Whether ``lease`` is a put reservation in the arena (its client writes the blocks
        through its own mapping), which must become an orphan rather than end while the client
        process lives (module docstring)."""
        return (lease.kind == "put" and isinstance(lease.handle, WriteLease) and lease.conn is not None
                and not lease.conn.writes_over)

    def orphan_locked(self, lease: Lease) -> None:
        """Keep ``lease`` (taken from the book) reserved for its process (module docstring)."""
        lease.pid = lease.conn.pid
        self._orphans[lease.id] = lease

    def take_orphan_locked(self, pid: int, lease_id: int) -> Lease | None:
        """Remove and return orphan ``lease_id`` if process ``pid`` holds it."""
        lease = self._orphans.get(lease_id)
        if lease is None or lease.pid != pid:
            return None
        return self._orphans.pop(lease_id)

    def take_orphans_of_locked(self, pid: int) -> list[Lease]:
        """Remove and return the orphans of process ``pid`` (it exited)."""
        out = [l for l in self._orphans.values() if l.pid == pid]
        for lease in out:
            del self._orphans[lease.id]
        return out

    def orphan_pids_locked(self) -> set[int]:
        return {l.pid for l in self._orphans.values()}

    def orphan_counts_locked(self) -> dict[str, int]:
        """``{"leases": n, "bytes": b}``: orphaned reservations and the arena bytes (whole blocks) they keep."""
        return {"leases": len(self._orphans),
                "bytes": sum(arena_footprint(l.arena_nbytes, self.block_bytes) for l in self._orphans.values())}

    def take_all(self) -> list[Lease]:
        """Remove and return every lease, orphans included (at shutdown)."""
        with self._lock:
            leases = list(self._by_id.values()) + list(self._orphans.values())
            self._orphans.clear()
            self._by_id.clear()
            self._held.clear()
            self._held_bytes.clear()
            self.held_total = 0
        return leases

    def take_of_locked(self, conn: Connection) -> list[Lease]:
        """Remove and return every lease of ``conn`` (at its disconnect); clears ``conn.leases``."""
        leases = [self._by_id.pop(i) for i in list(conn.leases) if i in self._by_id]
        conn.leases.clear()
        return leases

    def take_expired_locked(self, now: float) -> list[Lease]:
        """Remove and return every lease whose deadline is ``<= now`` (monotonic seconds)."""
        expired = [l for l in self._by_id.values() if l.deadline <= now]
        for lease in expired:
            del self._by_id[lease.id]
            if lease.conn is not None:
                lease.conn.leases.discard(lease.id)
        return expired

    def arena_places(self) -> dict[tuple, int]:
        """The host-arena places that the live leases and the orphaned reservations hold: the
        entry's extents (:func:`place_of`) -> its bytes. An entry several leases pin (a scheduler's
        pin and a worker's view, several engines reading it) is one place."""
        with self._lock:
            return {place_of(l.handle): l.arena_nbytes
                    for l in (*self._by_id.values(), *self._orphans.values()) if l.arena_nbytes}

    def counts_locked(self) -> dict[str, int]:
        """``{"put": n, "get": n}``: live leases by kind (process-held read leases count as ``get``)."""
        return {"put": sum(1 for l in self._by_id.values() if l.kind == "put"),
                "get": sum(1 for l in self._by_id.values() if l.kind == "get")}

    def held_counts_locked(self) -> dict[str, int]:
        """``{"leases": n, "bytes": b, "processes": p}``: the process-held leases, the arena bytes
        they pin (whole blocks, each entry once per process), and the processes holding them."""
        return {"leases": sum(1 for l in self._by_id.values() if l.conn is None),
                "bytes": self.held_total,
                "processes": len(self._held)}


def place_of(handle) -> tuple:
    """Where a read lease's bytes lie in the arena (the same for every lease of one entry)."""
    return tuple(map(tuple, handle.extents))


def end_lease(cache: TieredCache, lease: Lease, *, commit: bool) -> None:
    """End ``lease`` on ``cache``: commit (``commit=True``) or abort a reservation, release a pin
    (a scratch file's lease: store its bytes with ``put`` on commit; remove the file).

    Raises:
        EctierError: from :meth:`TieredCache.commit` (or ``put``) when ``commit``; otherwise errors
        are logged.
    """
    h = lease.handle
    try:
        if isinstance(h, DirectPut):
            h.commit(cache) if commit else h.abort()
        elif isinstance(h, DirectRead):
            h.release()
        elif lease.kind == "put":
            if commit:
                cache.commit(h)
            else:
                cache.abort(h)
        else:
            cache.release(h)
    except EctierError:
        if commit:
            raise
        log.exception("ending a %s lease failed", lease.kind)
