"""The daemon's lease upkeep: the reaper thread that expires leases and ends the pins of client
processes that exited, and the grant of process-held leases within the view bounds (a mixin of
:class:`~ectier.daemon.server.DaemonServer`; ``config_checks.view_pin_bounds`` resolves the bounds).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..logutil import RateLimitedLogger
from .connections import Connection
from .leases import end_lease, place_of
from .serving import shutdown_socket

__all__ = ["LeaseUpkeep"]

log = logging.getLogger("ectier.daemon")


class LeaseUpkeep:
    """Lease expiry and view grants of :class:`~ectier.daemon.server.DaemonServer` (module
    docstring); uses its ``config``, ``_lock``, ``leases``, ``holders``, ``cache``, ``counters``,
    ``prefetcher``, ``_stop``."""

    def _reap_loop(self) -> None:
        """Every ``min(1 s, daemon.lease_s / 4)``: expire leases, reclaim what exited processes
        held, expire prefetch pins. A round that raises is logged (one line per kind per minute)
        and the next one runs: a reaper that died would let no lease expire again."""
        interval = min(1.0, self.config.daemon.lease_s / 4)
        errors = RateLimitedLogger(log, 60.0)
        while not self._stop.wait(interval):
            for step in (self.expire_leases, self.reap_dead_holders,
                         self.prefetcher.expire if self.prefetcher is not None else None):
                if step is None:
                    continue
                try:
                    step()
                except Exception as exc:  # noqa: BLE001 (kept going, logged)
                    errors.log(logging.ERROR, (step.__name__, type(exc).__name__),
                               "lease reaper: %s failed: %r; it runs again in %.2f s", step.__name__, exc, interval)

    def grant_view(self, conn: Connection, handle: Any) -> tuple[int | None, str | None]:
        """A process-held lease of ``conn``'s process on ``handle`` (a ``ReadLease``), within
        ``daemon.view_pin_bytes`` (:mod:`ectier.daemon.holders`). Returns ``(lease id, None)``, or
        ``(None, reason)`` when refused (``handle`` is then still the caller's)."""
        return self.grant_views(conn, [handle])[0]

    def grant_views(self, conn: Connection, handles: list) -> list[tuple[int | None, str | None]]:
        """:meth:`grant_view` of each of ``handles`` in order, under one hold of the lock (each
        checked against the bounds as the ones before it left them): one result per handle."""
        pid, leases, holders = conn.pid, self.leases, self.holders
        out: list[tuple[int | None, str | None]] = []
        with self._lock:
            for handle in handles:
                place = place_of(handle)
                held = leases.held_bytes_locked(pid)
                more = leases.held_bytes_locked(pid, also=handle, place=place) - held
                reason = holders.refusal_locked(pid, held, held + more, leases.held_total + more)
                out.append((None, reason) if reason is not None
                           else (leases.grant_held_locked(pid, handle, place), None))
            granted = [lease_id for lease_id, _ in out if lease_id is not None]
            holders.counters["granted"] += len(granted)
            holders.counters["refused"] += len(out) - len(granted)
            conn.granted_now.extend(granted)
        return out

    def reap_dead_holders(self) -> int:
        """Release the process-held leases and the orphaned reservations of client processes
        that exited (pidfd readable), and stop watching processes that keep none. Returns how many
        leases were released."""
        with self._lock:
            dead = self.holders.dead_locked()
            leases = [l for pid in dead for l in self.leases.take_held_of_locked(pid)]
            self.holders.counters["released_dead"] += len(leases)
            orphans = [l for pid in dead for l in self.leases.take_orphans_of_locked(pid)]
            self.counters["orphans_ended"] += len(orphans)
            holding = self.leases.held_pids_locked() | self.leases.orphan_pids_locked()
            for pid in list(self.holders.watched_pids_locked()):
                if pid not in holding:
                    self.holders.forget_locked(pid)
        for lease in leases + orphans:
            end_lease(self.cache, lease, commit=False)
        if leases or orphans:
            log.info("client process(es) %s exited holding %d view lease(s) and %d orphaned put(s); reclaimed",
                     ", ".join(map(str, dead)), len(leases), len(orphans))
        return len(leases) + len(orphans)

    def keep_or_end_locked(self, leases: list) -> list:
        """Of ``leases`` taken from the book without a commit (expired, or their connection
        closed): keep each arena put reservation whose process lives on as an orphan (its blocks
        reserved until it says it is done or exits: :mod:`ectier.daemon.leases`); returns the
        others, for the caller to end."""
        end = []
        for lease in leases:
            if self.leases.may_be_written(lease) and self.holders.watch_locked(lease.conn.pid, lease.conn.pid_start):
                self.leases.orphan_locked(lease)
                self.counters["orphans"] += 1
            else:
                end.append(lease)
        return end

    def stats_orphans(self) -> dict[str, int]:
        """``{"leases", "bytes"}`` of the orphaned put reservations now."""
        with self._lock:
            return self.leases.orphan_counts_locked()

    def writes_over(self, conn: Connection) -> None:
        """``conn``'s client writes into none of its reservations any more (``bye``): at its close
        they end rather than become orphans."""
        with self._lock:
            conn.writes_over = True

    def end_orphan(self, conn: Connection, lease_id: int) -> bool:
        """End orphan ``lease_id`` if ``conn``'s process holds it (it says its copy is over: an
        ``abort`` naming it); True if it did."""
        with self._lock:
            lease = self.leases.take_orphan_locked(conn.pid, lease_id)
            if lease is not None:
                self.counters["orphans_ended"] += 1
        if lease is None:
            return False
        end_lease(self.cache, lease, commit=False)
        return True

    def expire_leases(self, now: float | None = None) -> int:
        """End every lease past its deadline and close its connection (an arena put of a live
        process is kept as an orphan instead: :meth:`keep_or_end_locked`). Returns how many expired."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = self.leases.take_expired_locked(now)
            self.counters["leases_expired"] += len(expired)
            ending = self.keep_or_end_locked(expired)
        for lease in expired:  # never a process-held lease (no deadline)
            kept = lease not in ending
            log.warning("lease %d (%s) of client %s (pid %d) expired after daemon.lease_s=%s; %s",
                        lease.id, lease.kind, lease.conn.name, lease.conn.pid, self.config.daemon.lease_s,
                        "its blocks stay reserved until the client aborts it or exits" if kept else "reclaimed")
            if not kept:
                end_lease(self.cache, lease, commit=False)
            lease.conn.closed = True
            shutdown_socket(lease.conn.sock)
        return len(expired)
