"""The catalog: which version of each key is current, which writes are in flight, one lock.

Every tier holds bytes of some *version* of a key; the catalog says which version is the key's
current one (``current``), so a late demotion or promotion of older bytes is never served. Writes
into a tier that complete later (a put of a CUDA tensor, a GPU victim's D2H into the host arena)
are :class:`PendingWrite` s until their copy completes; a ``get`` waits for them.

The catalog's condition variable (``cond``) is *the* lock of a cache: the tiers' indexes and the
catalog change only under it, copies and I/O never run under it, and waiters (an admission waiting
for room, a delete waiting for a write) wait on it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .handles import PutHandle

__all__ = ["Catalog", "PendingWrite"]


@dataclass(eq=False)
class PendingWrite:
    """A write into a tier whose copy is in flight (a put of a device tensor, a GPU demotion).

    ``cancelled``: a delete (or close) came after it; its commit becomes an abort.
    ``finished``: the write ended (committed or not).
    """

    digest: bytes
    version: int
    handle: PutHandle
    cancelled: bool = False
    finished: bool = False


class _Condition(threading.Condition):
    """A :class:`threading.Condition` whose ``notify_all`` costs nothing when nobody waits (most
    calls: a put that replaced an entry, an unpin that freed blocks). ``_waiters`` is read under
    the lock, where every waiter enlists before it releases it, so no wake-up is lost."""

    def notify_all(self) -> None:
        if self._waiters:
            super().notify_all()


class Catalog:
    """Current version per key, writes in flight, recompute costs — guarded by ``cond``.

    Not thread-safe by itself: callers hold ``cond`` around every method except
    :meth:`wait_inflight` (which takes it).
    """

    def __init__(self) -> None:
        #: the cache's one lock, also as ``cond`` (a Condition on it). ``with lock:`` is the same lock
        #: without the Condition's Python-level ``__enter__``/``__exit__`` (hot paths use it)
        self.lock = threading.Lock()
        self.cond = _Condition(self.lock)
        #: the Condition's waiters (a deque, empty while nobody waits): a hot path reads it to skip
        #: ``cond.notify_all()`` altogether, under the lock (see :class:`_Condition`)
        self.waiters = self.cond._waiters
        #: digest -> current version (what :meth:`version` / :meth:`set_current` read and write);
        #: a commit reads and sets it directly, under ``cond``
        self.versions: dict[bytes, int] = {}
        #: digest -> its writes in flight (a key is absent while it has none); read under the GIL
        #: by a get before :meth:`wait_inflight`, changed under ``cond``
        self.inflight: dict[bytes, list[PendingWrite]] = {}
        #: recompute seconds per digest (:meth:`set_cost`); read under ``cond``
        self.costs: dict[bytes, float] = {}
        #: deletes so far (any key), counted under ``cond``: a remote fetch that saw it change
        #: while it ran takes its placed copy out again (ectier/moves/remote.py)
        self.deletes = 0
        #: digest -> deletes of it running now (their remote delete not returned yet); under ``cond``
        self.deleting: dict[bytes, int] = {}

    # ------------------------------------------------------------------------------ versions
    def version(self, digest: bytes) -> int | None:
        """The current version of ``digest``, ``None`` if the key is stored nowhere."""
        return self.versions.get(digest)

    def is_current(self, digest: bytes, version: int) -> bool:
        return self.versions.get(digest) == version

    def set_current(self, digest: bytes, version: int) -> None:
        self.versions[digest] = version

    def set_current_many(self, pairs: list[tuple[bytes, int]]) -> None:
        """:meth:`set_current` of every ``(digest, version)`` pair, in one call (opening a store)."""
        self.versions.update(pairs)

    def forget(self, digest: bytes, version: int | None = None) -> bool:
        """Drop ``digest`` (only if its current version is ``version``, when given). True if dropped."""
        if version is not None and self.versions.get(digest) != version:
            return False
        return self.versions.pop(digest, None) is not None

    def __len__(self) -> int:
        return len(self.versions)

    def __contains__(self, digest: object) -> bool:
        return digest in self.versions

    def items(self) -> list[tuple[bytes, int]]:
        """``(digest, current version)`` pairs (a copy)."""
        return list(self.versions.items())

    def notify(self) -> None:
        self.cond.notify_all()

    # ------------------------------------------------------------------------------ in flight
    def add_pending(self, pending: PendingWrite) -> None:
        self.inflight.setdefault(pending.digest, []).append(pending)

    def end_pending(self, pending: PendingWrite) -> None:
        lst = self.inflight.get(pending.digest)
        if lst is not None and pending in lst:
            lst.remove(pending)
            if not lst:
                del self.inflight[pending.digest]
        pending.finished = True

    def pending(self, digest: bytes) -> list[PendingWrite]:
        """Writes of ``digest`` in flight, oldest first (a copy)."""
        return list(self.inflight.get(digest, ()))

    def has_pending(self, digest: bytes, version: int | None = None) -> bool:
        """Whether a write of ``digest`` (of ``version``, when given) is in flight and unfinished."""
        return any(version is None or (p.version == version and not p.finished)
                   for p in self.inflight.get(digest, ()))

    def pending_count(self) -> int:
        return sum(len(v) for v in self.inflight.values())

    def cancel_pending(self, digest: bytes) -> bool:
        """Mark every write of ``digest`` in flight as cancelled; True if there was one."""
        lst = self.inflight.get(digest, ())
        for p in lst:
            p.cancelled = True
        return bool(lst)

    def wait_inflight(self, digest: bytes) -> None:
        """Wait (without the lock) for the writes of ``digest`` in flight now."""
        if digest not in self.inflight:
            return  # none now (a write added under the lock from here on started after this call)
        with self.cond:
            pend = self.pending(digest)
        for p in pend:
            p.handle.wait()

    # ------------------------------------------------------------------------------ costs
    def set_cost(self, digest: bytes, cost_s: float | None) -> None:
        """Remember the recompute seconds of ``digest`` for the tiers' policies (``None``: unknown)."""
        if cost_s is None:
            self.costs.pop(digest, None)
            return
        self.costs[digest] = float(cost_s)
        if len(self.costs) > 2 * len(self.versions) + 1024:  # forget keys no longer stored
            self.costs = {d: c for d, c in self.costs.items() if d in self.versions or d == digest}

    def update_cost(self, digest: bytes, cost_s: float | None) -> None:
        """:meth:`set_cost` under ``cond`` (takes it), skipped when there is nothing to change: no
        cost given for a key that has none (a put without ``cost_s``, the common case)."""
        if cost_s is None and digest not in self.costs:
            return  # as if a concurrent put's set_cost came after this one
        with self.cond:
            self.set_cost(digest, cost_s)

    def put_cost(self, digest: bytes, cost_s: float | None) -> float | None:
        """:meth:`set_cost` for a put of ``digest`` (``None`` forgets an earlier cost), then the
        cost its slot carries (seconds, ``None``: unknown). Under ``cond``."""
        self.set_cost(digest, cost_s)
        return None if cost_s is None else self.costs[digest]

    def cost(self, digest: bytes) -> float | None:
        return self.costs.get(digest)
