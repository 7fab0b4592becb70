"""Write-behind: dirty host entries nearest eviction are written to NVMe in the background.

The tiers are inclusive: a host entry whose version NVMe holds (``Slot.lower_copy``, "clean")
costs nothing to evict. An entry put into the host and never written down is *dirty*: evicting it
means writing it to NVMe inside the call that needs the room (a put, or the promotion of an NVMe
hit). :class:`WriteBehind` keeps the least-recently-used end of the host tier clean ahead of need,
so that those calls find clean victims.

The window: ``host.write_behind_fraction * host.capacity_bytes`` bytes, counted from the
least-recently-used end of the tier (the tier's free bytes count first: with that much free, there
is nothing to do). Every dirty entry inside it is written to NVMe, oldest first, one at a time,
by one daemon thread (``ectier-write-behind``) — woken by every commit into the host tier (a put
or a promotion: the window moved), never during an admission (the thread's pins would turn the
admission's victims away) and never polling.

Per-entry discipline (the same as a demotion's, docs/architecture.md "Versions" and
docs/reliability.md): the thread picks and pins the slot under the cache lock, writes it outside
the lock through :meth:`~ectier.moves.nvme.NvmeMoves.demote_slot` (a write of the version the slot
holds, never registering it: NVMe's write is conditional on the version and a write that finishes
after a newer put or a delete of the key is deleted as stale), and unpins it. A pinned slot is
never chosen as a victim, so an eviction picks another one meanwhile. A failed write leaves the
entry dirty in the host (counted ``write_behind_failures``), retried after :data:`RETRY_AFTER_S`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from ..entry import EntryState
from ..index import Slot
from ..tiers.arena import ArenaTier

if TYPE_CHECKING:
    from ..mover import Mover

__all__ = ["WriteBehind", "RETRY_AFTER_S"]

log = logging.getLogger(__name__)

#: seconds before an entry whose write-behind failed (I/O error, NVMe budget held) is tried again
RETRY_AFTER_S = 1.0


class WriteBehind:
    """Keeps the ``reserve_bytes`` at the least-recently-used end of ``host`` written to NVMe.

    Args:
        m: the mover (its NVMe moves do the writes; its lock guards the bookkeeping).
        host: the host tier.
        reserve_bytes: the window in bytes (``host.write_behind_fraction * capacity``), > 0.
    """

    def __init__(self, m: "Mover", host: ArenaTier, reserve_bytes: int) -> None:
        self.m = m
        self.host = host
        self.reserve_bytes = reserve_bytes
        self._cv = threading.Condition(threading.Lock())  # guards the fields below; never held with m.cond
        self._thread: threading.Thread | None = None
        self._poked = False
        self._stop = False
        self._idle = True
        self._retry_at: dict[tuple[bytes, int], float] = {}  # failed writes: (digest, version) -> when
        self._warned = False
        self.writing: tuple[bytes, int] | None = None  # (digest, version) written now; guarded by m.cond

    # ------------------------------------------------------------------------- control
    def poke(self) -> None:
        """Ask for a round (the host's window may have dirty entries). Any thread, with or without
        the cache lock; never waits for a write. Starts the thread at the first call."""
        with self._cv:
            if self._stop:
                return
            self._poked = True
            self._idle = False
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ectier-write-behind", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def wait_idle(self, timeout_s: float | None = 10.0) -> bool:
        """Wait until no write is in flight and no round is pending; False on timeout (seconds)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while not self._idle:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cv.wait(remaining)
            return True

    def close(self) -> None:
        """Stop the thread: the write in flight (one entry at most) finishes first. Idempotent."""
        with self._cv:
            self._stop = True
            thread = self._thread
            self._cv.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # ------------------------------------------------------------------------- the thread
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._poked and not self._stop:
                    self._idle = True
                    self._cv.notify_all()
                    self._cv.wait(self._next_retry_s())
                    if self._pop_due():
                        self._poked = True
                if self._stop:
                    self._idle = True
                    self._cv.notify_all()
                    return
                self._poked = False
                self._idle = False
                self._pop_due()
            try:
                self._round()
            except Exception:  # never let the thread die: a round's error only costs that round
                log.exception("write-behind: a round failed; host entries are written on eviction meanwhile")

    def _next_retry_s(self) -> float | None:
        if not self._retry_at:
            return None
        return max(0.0, min(self._retry_at.values()) - time.monotonic())

    def _pop_due(self) -> bool:
        """Forget the failed writes whose wait is over (they may be picked again); True if any."""
        now = time.monotonic()
        due = [k for k, t in self._retry_at.items() if t <= now]
        for k in due:
            del self._retry_at[k]
        return bool(due)

    def _round(self) -> None:
        """Write the dirty entries of the window, oldest first, each at most once this round (an
        NVMe eviction made room for one may un-clean another: no ping-pong)."""
        done: set[tuple[bytes, int]] = set()
        m, host = self.m, self.host
        while not self._stop:
            with m.cond:
                slot = self._pick_locked(done)
                if slot is None:
                    return
                host.pin(slot)
                self.writing = (slot.digest, slot.version)
            done.add((slot.digest, slot.version))
            try:
                self._write(slot)
            finally:
                with m.cond:
                    self.writing = None
                    host.unpin(slot)
                    m.cond.notify_all()  # room freed, and an overwrite or delete of it may return

    def _pick_locked(self, done: set[tuple[bytes, int]]) -> Slot | None:
        """The least recently used dirty, writable entry inside the window, or ``None``."""
        m, host, nvme = self.m, self.host, self.m.nvme.tier
        budget = self.reserve_bytes - (host.capacity_bytes - host.used_bytes)
        if budget <= 0:
            return None
        for s in host.slots():  # least recently used first
            if budget <= 0:
                return None
            if s.state is not EntryState.COMMITTED or not s.visible:
                continue
            budget -= s.alloc_bytes
            if s.lower_copy:
                continue
            ident = (s.digest, s.version)
            if nvme.holds(s.digest, s.version):
                s.lower_copy = True  # the slot's field, marked by the mover's side (docs/architecture.md)
                continue
            if ident in done or ident in self._retry_at:
                continue
            if not nvme.fits(s.meta.nbytes) or not m.catalog.is_current(s.digest, s.version):
                continue
            return s
        return None

    def _write(self, slot: Slot) -> None:
        """Write one pinned slot to NVMe; count it, or count the failure (the entry stays dirty)."""
        m = self.m
        ok = m.run_move("write-behind host -> nvme", m.nvme.demote_slot, self.host, slot, write_behind=True)
        if ok:
            m.counters.count("host", write_behind_writes=1, write_behind_bytes=slot.meta.nbytes)
            self._warned = False
            return
        with m.cond:
            # not written: fine if the key changed meanwhile (a newer put, a delete), a failure else
            failed = (m.catalog.is_current(slot.digest, slot.version) and slot.visible
                      and not m.nvme.tier.holds(slot.digest, slot.version))
        if failed:
            m.counters.count("host", write_behind_failures=1)
            self._retry_at[slot.digest, slot.version] = time.monotonic() + RETRY_AFTER_S  # the thread's own
            if not self._warned:
                self._warned = True
                log.warning("write-behind: an entry could not be written to NVMe now (no room NVMe could free "
                            "at once: its budget held by writes or reads in flight; or a write error, logged "
                            "at DEBUG); it stays in host memory, written on eviction or retried in %.0f s. "
                            "Counted in host.write_behind_failures; logged once until a write succeeds",
                            RETRY_AFTER_S)
