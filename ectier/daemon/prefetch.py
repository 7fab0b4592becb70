"""The daemon's asynchronous prefetch: the ``prefetch`` op promotes NVMe entries into the host
arena in the daemon's own threads and answers at once.

For each key, :meth:`Prefetcher.states` answers from memory (no I/O in the request's thread):

- ``"absent"``: stored nowhere, or its promotion failed (answered once; the next ``prefetch``
  tries again), or (a client without ``direct``) it cannot be leased through the arena;
  with a remote tier, a key stored nowhere locally is first ``"promoting"`` while the cache's
  fetch pool asks the store (then ``"ready"``, fetched into the arena, or ``"absent"``);
- ``"ready"``: a ``get`` pins it now without I/O: it is in the host arena, or a finished promotion
  holds it for the next ``get``;
- ``"promoting"``: a promotion runs in a worker thread; ask again later.

A promotion is :meth:`TieredCache.prefetch <ectier.cache.TieredCache.prefetch>` (the cache's own
pool copies NVMe → host), then, in a worker thread of this module, :meth:`TieredCache.acquire`
(a host hit by then: no I/O) so that the entry stays in the arena until a client's ``get`` takes
that pin over (:meth:`Prefetcher.take`). An entry that cannot be leased through the arena (larger
than ``host.capacity_bytes``, or no room) is read from NVMe into a scratch file instead
(:class:`~ectier.daemon.scratch.DirectRead`) when the asking client reads directly
(``direct: true``). A held pin or scratch file lasts until a ``get`` takes it, a put or delete of
its key, or ``daemon.lease_s`` (the reaper, :meth:`Prefetcher.expire`); pins are held for at most
half of the host arena's bytes (:attr:`Prefetcher.max_held_bytes`), each held entry counted as
the whole ``host.block_bytes`` blocks it occupies (:func:`~ectier.daemon.leases.arena_footprint`:
80 KB in 256 KiB blocks is 256 KiB), so many small entries cannot pin more than half the arena;
beyond that a promoted entry is left unpinned in the arena: a ``get`` still finds it there unless
it was evicted meanwhile. The stats' ``held_bytes`` are these arena bytes (blocks x block size).
Held scratch files take at most ``host.capacity_bytes`` of ``daemon.shm_dir`` together
(:attr:`Prefetcher.max_held_scratch_bytes`; ``held_scratch_bytes`` in the stats), or one file,
which may be larger (an entry larger than the arena is still served): a direct read past that is
answered ``"absent"`` (a miss, counted as ``scratch_refused``; no further read) until a held
scratch file is let go, then read again at its next ``prefetch``.

Held pins give way to puts: held pins and zero-copy view pins (``daemon.view_pin_total_bytes``,
default half the arena too) may together pin the whole arena, so a ``reserve`` that finds too few
unpinned blocks for its entry first ends held pins, oldest first (:meth:`Prefetcher.give_way`,
counted as ``yielded``), instead of waiting ``host.admit_wait_s`` for room no reader would
release. Their entries stay in the arena unpinned (a ``get`` still finds them unless evicted).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..cache import ReadLease, TieredCache
from ..errors import EctierError
from ..tiers.nvme_reader import mark_background
from .leases import arena_footprint, place_of
from .scratch import DirectRead

__all__ = ["Prefetcher", "Held", "ABSENT", "READY", "PROMOTING"]

log = logging.getLogger("ectier.daemon")

ABSENT, READY, PROMOTING = "absent", "ready", "promoting"
#: worker threads (each waits for one promotion of the cache's pool, then pins it)
WORKERS = 4


@dataclass
class Held:
    """A finished promotion waiting for its ``get``: a host-arena pin or a scratch file.
    ``arena_nbytes``: the host-arena bytes it pins, in whole blocks (0 for a scratch file);
    ``scratch_nbytes``: the bytes of its scratch file (0 for an arena pin)."""

    handle: ReadLease | DirectRead
    deadline: float  # time.monotonic() seconds
    arena_nbytes: int = 0
    scratch_nbytes: int = 0  # the bytes of its scratch file in daemon.shm_dir (0 for an arena pin)


class Prefetcher:
    """Promotions for the ``prefetch`` op (see the module docstring).

    Args:
        cache: the daemon's cache.
        hold_s: how long a finished promotion holds its pin for a ``get`` (``daemon.lease_s``).
        scratch_dir: ``daemon.shm_dir`` (scratch files of direct reads). gid: their group.
    """

    def __init__(self, cache: TieredCache, *, hold_s: float, scratch_dir: str, gid: int | None = None) -> None:
        self.cache = cache
        self.hold_s = hold_s
        self.scratch_dir = scratch_dir
        self.gid = gid
        self.block_bytes = cache.config.host.block_bytes
        #: the most arena bytes (whole blocks of the held entries) the held pins may take
        self.max_held_bytes = cache.host_arena_bytes // 2
        self._held_arena = 0  # arena bytes of _held plus of pins granted by _hold not yet kept
        #: the most bytes held scratch files may take in daemon.shm_dir beyond the first one (which
        #: may be larger: an entry larger than the arena is still served)
        self.max_held_scratch_bytes = cache.host_arena_bytes
        self._held_scratch = 0  # scratch bytes of _held plus of direct reads granted, not yet kept
        #: keys whose direct read found the held scratch files full: absent (no read) until some
        #: held scratch file is let go
        self._refused: set[tuple[str, str]] = set()
        self.remote = cache.config.remote.enabled  # a key stored nowhere here may be on the store
        self._lock = threading.Lock()
        self._running: dict[tuple[str, str], bool] = {}  # (ns, key) -> direct wanted
        #: pins being taken for a key now (a worker, or a request's host hit): a put or delete of
        #: the key marks them stale, and a stale pin is let go instead of kept (it holds the older version)
        self._tickets: dict[tuple[str, str], list[_Ticket]] = {}
        self._failed: set[tuple[str, str]] = set()
        self._held: dict[tuple[str, str], Held] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._warned: set[tuple[str, str]] = set()
        self.counters = {"started": 0, "promoted": 0, "failed": 0, "direct_reads": 0, "scratch_refused": 0,
                         "expired": 0, "taken": 0, "yielded": 0}

    # ------------------------------------------------------------------------ the op

    def states(self, keys: list[str], namespace: str | None, *, direct: bool) -> list[str]:
        """One state per key (module docstring), starting the promotions needed. No I/O here."""
        ns = self._ns(namespace)
        return [self._state((ns, key), direct) for key in keys]

    def _ns(self, namespace: str | None) -> str:
        return self.cache.config.namespace if namespace is None else namespace

    def _state(self, ident: tuple[str, str], direct: bool) -> str:
        ns, key = ident
        with self._lock:
            if ident in self._held:
                return READY
            if ident in self._running:
                return PROMOTING
            if ident in self._failed:
                self._failed.discard(ident)
                return ABSENT
            if ident in self._refused:
                return ABSENT
        if not self.cache.contains(key, namespace=ns):
            if not self.remote:
                return ABSENT
            # maybe on the remote store: the cache's fetch pool asks it (no I/O here)
            return self._start(ident, self.cache.prefetch([key], namespace=ns)[0], direct)
        return self._local(ident, direct)

    def _local(self, ident: tuple[str, str], direct: bool) -> str:
        """The state of a key stored here. A prefetch handle done at once means: in the arena, gone,
        or on NVMe and larger than the arena; else a worker waits for the promotion."""
        ns, key = ident
        for _ in range(2):  # twice: an entry evicted and promoted again in between is pinned then
            handle = self.cache.prefetch([key], namespace=ns)[0]
            if not handle.done():
                return self._start(ident, handle, direct)
            if not handle.wait(0):
                return ABSENT
            # pinned only if in the arena now (a host hit: never I/O on the request's thread)
            ticket, held = self._ticket(ident), None
            try:
                held = self._hold(self.cache.acquire(key, namespace=ns, promote=False, count=False), ns, key)
            finally:
                if held is None:
                    with self._lock:
                        self._end_ticket(ident, ticket)
            if held is not None:
                self._keep(ident, held, ticket)
                return READY
            if not self.cache.contains(key, namespace=ns):
                return ABSENT
        if direct:  # on NVMe and larger than the arena: a worker reads it into a scratch file
            return self._start(ident, handle, direct)
        self.unleasable(ns, key)  # no lease through the arena: a protocol-1 client misses it
        return ABSENT

    def _start(self, ident: tuple[str, str], handle: Any, direct: bool) -> str:
        with self._lock:
            if self._closed:
                return ABSENT
            if ident in self._running or ident in self._held:
                return PROMOTING if ident in self._running else READY
            self._running[ident] = direct
            self.counters["started"] += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="ectier-daemon-prefetch",
                                                initializer=mark_background)
            self._pool.submit(self._finish, ident, handle, self._ticket_locked(ident))
        return PROMOTING

    def _ticket(self, ident: tuple[str, str]) -> "_Ticket":
        with self._lock:
            return self._ticket_locked(ident)

    def _ticket_locked(self, ident: tuple[str, str]) -> "_Ticket":
        """Under ``_lock``: a new ticket for a pin of ``ident`` being taken."""
        ticket = _Ticket()
        self._tickets.setdefault(ident, []).append(ticket)
        return ticket

    def _end_ticket(self, ident: tuple[str, str], ticket: "_Ticket") -> None:
        """Under ``_lock``: ``ticket``'s pin was kept or let go."""
        tickets = self._tickets.get(ident)
        if tickets is not None and ticket in tickets:
            tickets.remove(ticket)
            if not tickets:
                del self._tickets[ident]

    def _keep(self, ident: tuple[str, str], held: Held, ticket: "_Ticket") -> None:
        """Hold ``held`` for the next get of ``ident`` (an unpinned one is not kept: the next
        ``prefetch`` finds the entry in the arena by itself; one whose ``ticket`` a put or
        delete of the key marked stale is let go: it pins the older version)."""
        with self._lock:
            stale = self._keep_locked(ident, held, ticket)
        if stale is not None:
            _end(self.cache, stale)

    def _keep_locked(self, ident: tuple[str, str], held: Held, ticket: "_Ticket") -> Held | None:
        """:meth:`_keep` under ``_lock``; returns the pin to end (:func:`_end`) once it is let go."""
        self._end_ticket(ident, ticket)
        if held is UNPINNED:
            return None
        drop = self._closed or ticket.stale
        stale = held if drop else self._held.pop(ident, None)
        if not drop:
            self._held[ident] = held
        if stale is not None:
            self._unhold(stale)
        return stale

    def _finish(self, ident: tuple[str, str], handle: Any, ticket: "_Ticket") -> None:
        """Worker: wait for the cache's promotion, pin the entry (or read it into a scratch file)."""
        ns, key = ident
        held = None
        try:
            # not found and not here: stored nowhere, not even remotely (no second remote call)
            if handle.wait() or self.cache.contains(key, namespace=ns):
                held = self._pin(ns, key, self._running.get(ident, False))
        except Exception as exc:  # noqa: BLE001 - a failed promotion is a miss, logged
            log.warning("prefetch of a key failed: %s: %s", type(exc).__name__, exc)
        with self._lock:
            self._running.pop(ident, None)
            if held is None or held is REFUSED:
                self._end_ticket(ident, ticket)
                if not ticket.stale:  # (a put or delete meanwhile: the next prefetch starts again)
                    self._failed.add(ident)
                self.counters["failed"] += held is None  # (a refusal is counted as scratch_refused)
                return
            self.counters["promoted"] += 1
            # kept under the same hold of the lock that ends the run: a prefetch in between found the
            # key neither running nor held and started it again (for an entry larger than the arena,
            # a second direct read, refused by the held scratch budget and counted as scratch_refused)
            stale = self._keep_locked(ident, held, ticket)
        if stale is not None:
            _end(self.cache, stale)

    def _hold(self, lease: ReadLease | None, ns: str, key: str) -> Held | None:
        """A held pin of ``lease`` (None: no lease); over the held-bytes budget (the arena blocks
        of the held pins and this one past :attr:`max_held_bytes`) the lease is let go at once
        (:data:`UNPINNED`): the entry, in the arena, is ready without a pin. A pin granted here
        counts against the budget at once (so concurrent workers cannot overshoot it) and until
        it is taken, forgotten, expired or closed."""
        if lease is None:
            return None
        nbytes = arena_footprint(lease.meta.nbytes, self.block_bytes)
        with self._lock:
            room = self._held_arena + nbytes <= self.max_held_bytes
            if room:
                self._held_arena += nbytes
        if room:
            return Held(lease, time.monotonic() + self.hold_s, nbytes)
        self.cache.release(lease)  # in the arena, unpinned: a get finds it there
        return UNPINNED

    def _pin(self, ns: str, key: str, direct: bool) -> Held | None:
        held = self._hold(self.cache.acquire(key, namespace=ns, promote=False, count=False), ns, key)  # a host hit: no I/O
        if held is not None or self._closed:
            return held
        # the reads (an entry evicted since its promotion, a direct read from NVMe) share the
        # cache's prefetch_threads slots with its promotions, each on one thread (no read helper)
        with self.cache.background_read():
            return None if self._closed else self._pin_read(ns, key, direct)

    def _pin_read(self, ns: str, key: str, direct: bool) -> Held | None:
        held = self._hold(self.cache.acquire(key, namespace=ns, count=False), ns, key)
        if held is not None or not self.cache.contains(key, namespace=ns):
            return held
        if not direct:
            self.unleasable(ns, key)
            return None
        tensor = self.cache.get(key, namespace=ns)  # from NVMe: it does not go through the arena
        if tensor is None:
            return None
        nbytes = tensor.nbytes
        with self._lock:  # held scratch files keep to max_held_scratch_bytes, or are one file
            room = self._held_scratch == 0 or self._held_scratch + nbytes <= self.max_held_scratch_bytes
            if room:
                self._held_scratch += nbytes
            else:
                self._refused.add((ns, key))
            self.counters["direct_reads" if room else "scratch_refused"] += 1
        if not room:
            return REFUSED  # absent (a miss) until a held scratch file is let go (_unhold)
        try:
            return Held(DirectRead.of(tensor, self.scratch_dir, gid=self.gid), time.monotonic() + self.hold_s,
                        scratch_nbytes=nbytes)
        except BaseException:
            with self._lock:
                self._held_scratch -= nbytes
                self._refused.clear()
            raise

    def unleasable(self, ns: str | None, key: str) -> None:
        """Log (once per key) that a stored entry cannot be leased through the arena."""
        ns = self._ns(ns)
        with self._lock:
            first = (ns, key) not in self._warned
            if first and len(self._warned) < 10000:
                self._warned.add((ns, key))
        if first:
            log.warning("entry %r (namespace %s) is stored but cannot be leased through the host arena "
                        "(larger than host.capacity_bytes=%d, or no room): a get without direct reads misses "
                        "it; clients that read directly (DaemonClient of this version) get it through a "
                        "scratch file", key[:80], ns, self.cache.host_arena_bytes)

    # ------------------------------------------------------------------------ pins held

    def take(self, namespace: str | None, key: str, *, direct: bool) -> Held | None:
        """The held pin of a finished promotion of ``key``, handed to a ``get`` (None: none; a
        scratch file only to a get with ``direct``)."""
        ident = (self._ns(namespace), key)
        with self._lock:
            held = self._held.get(ident)
            if held is None or (not direct and not isinstance(held.handle, ReadLease)):
                return None
            del self._held[ident]
            self._unhold(held)
            self.counters["taken"] += 1
        return held

    def take_many(self, namespace: str | None, keys: list[str]) -> dict[str, Held]:
        """:meth:`take` (without ``direct``: pins in the arena only) of each of ``keys`` under one
        hold of the lock: key -> the held pin, for the keys that had one."""
        ns = self._ns(namespace)
        taken: dict[str, Held] = {}
        with self._lock:
            if not self._held:
                return taken
            for key in keys:
                held = self._held.get((ns, key))
                if held is not None and isinstance(held.handle, ReadLease):
                    del self._held[(ns, key)]
                    self._unhold(held)
                    taken[key] = held
            self.counters["taken"] += len(taken)
        return taken

    def forget(self, namespace: str | None, key: str) -> None:
        """A put or delete of ``key``: drop what a promotion holds of its older version."""
        ident = (self._ns(namespace), key)
        with self._lock:
            held = self._held.pop(ident, None)
            if held is not None:
                self._unhold(held)
            for ticket in self._tickets.get(ident, ()):
                ticket.stale = True  # a pin being taken now is of the older version
            self._failed.discard(ident)
            self._refused.discard(ident)
            self._warned.discard(ident)
        if held is not None:
            _end(self.cache, held)

    def expire(self, now: float | None = None) -> int:
        """End held pins past their deadline (the reaper). Returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = [i for i, h in self._held.items() if h.deadline <= now]
            stale = [self._held.pop(i) for i in gone]
            for h in stale:
                self._unhold(h)
            self.counters["expired"] += len(stale)
        for held in stale:
            _end(self.cache, held)
        return len(stale)

    def held_places(self) -> dict[tuple, int]:
        """The host-arena places the held pins hold: the entry's extents -> its bytes."""
        with self._lock:
            return {place_of(h.handle): h.arena_nbytes for h in self._held.values() if h.arena_nbytes}

    def give_way(self, nbytes: int, keep: set[tuple] = frozenset()) -> int:
        """End held arena pins, those nearest their deadline first, until they free at least
        ``nbytes`` of the arena (in whole blocks) or none is left: a put needs the room (module
        docstring). A pin whose place is in ``keep`` (an entry also pinned otherwise: ending it
        would free nothing) is kept. Returns the arena bytes freed."""
        with self._lock:
            pins = sorted(((h.deadline, i) for i, h in self._held.items()
                           if h.arena_nbytes and place_of(h.handle) not in keep), key=lambda p: p[0])
            ended, freed = [], 0
            for _, ident in pins:
                if freed >= nbytes:
                    break
                held = self._held.pop(ident)
                self._unhold(held)
                freed += held.arena_nbytes
                ended.append(held)
            self.counters["yielded"] += len(ended)
        for held in ended:
            _end(self.cache, held)
        return freed

    def _unhold(self, held: Held) -> None:
        """``held`` left the held set (under the lock): its bytes leave the budgets."""
        self._held_arena -= held.arena_nbytes
        if held.scratch_nbytes:
            self._held_scratch -= held.scratch_nbytes
            self._refused.clear()  # room again: the refused keys are read at their next prefetch

    def stats(self) -> dict[str, Any]:
        """The counters, plus ``running`` (promotions in flight), ``held`` (finished ones holding
        a pin or scratch file for a ``get``), ``held_bytes``: the host-arena bytes those pins
        occupy, in whole blocks (blocks x ``host.block_bytes``, not the entries' ``nbytes``; at
        most :attr:`max_held_bytes`), and ``held_scratch_bytes``: the bytes of the held scratch
        files in ``daemon.shm_dir`` (at most :attr:`max_held_scratch_bytes`, or one file)."""
        with self._lock:
            return {**self.counters, "running": len(self._running), "held": len(self._held),
                    "held_bytes": sum(h.arena_nbytes for h in self._held.values()),
                    "held_scratch_bytes": sum(h.scratch_nbytes for h in self._held.values())}

    def close(self) -> None:
        """Wait for the promotions in flight, then end every held pin."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)  # (the queued ones' keys stay in _running)
        with self._lock:
            held, self._held = list(self._held.values()), {}
            for h in held:
                self._unhold(h)
        for h in held:
            _end(self.cache, h)


class _Ticket:
    """A pin being taken for a key (:attr:`Prefetcher._tickets`); ``stale`` once a put or delete
    of the key came meanwhile."""

    __slots__ = ("stale",)

    def __init__(self) -> None:
        self.stale = False


#: a finished promotion over the held-bytes budget: ready in the arena, not pinned, not kept
UNPINNED: Any = Held(None, 0.0)
#: a direct read refused by the held scratch budget: absent, not kept, not counted as a failure
REFUSED: Any = Held(None, 0.0)


def _end(cache: TieredCache, held: Held) -> None:
    try:
        if isinstance(held.handle, ReadLease):
            cache.release(held.handle)
        else:
            held.handle.release()
    except EctierError:
        log.exception("releasing a prefetch pin failed")
