"""The daemon's lease upkeep: the reaper thread that expires leases and ends the pins of client
processes that exited, and the grant of process-held leases within the view bounds (a mixin of
:class:`~ectier.daemon.server.DaemonServer`; ``config_checks.view_pin_bounds`` resolves the bounds).
"""

from __future__ import annotations

import logging
import time
from typing import Any

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
        interval = min(1.0, self.config.daemon.lease_s / 4)
        while not self._stop.wait(interval):
            self.expire_leases()
            self.reap_dead_holders()
            if self.prefetcher is not None:
                self.prefetcher.expire()

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
        """Release the process-held leases of client processes that exited (pidfd readable), and
        stop watching processes that hold none. Returns how many leases were released."""
        with self._lock:
            dead = self.holders.dead_locked()
            leases = [l for pid in dead for l in self.leases.take_held_of_locked(pid)]
            self.holders.counters["released_dead"] += len(leases)
            holding = self.leases.held_pids_locked()
            for pid in list(self.holders.watched_pids_locked()):
                if pid not in holding:
                    self.holders.forget_locked(pid)
        for lease in leases:
            end_lease(self.cache, lease, commit=False)
        if leases:
            log.info("client process(es) %s exited holding %d view lease(s); reclaimed",
                     ", ".join(map(str, dead)), len(leases))
        return len(leases)

    def expire_leases(self, now: float | None = None) -> int:
        """End every lease past its deadline and close its connection. Returns how many expired."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = self.leases.take_expired_locked(now)
            self.counters["leases_expired"] += len(expired)
        for lease in expired:  # never a process-held lease (no deadline)
            log.warning("lease %d (%s) of client %s (pid %d) expired after daemon.lease_s=%s; reclaimed",
                        lease.id, lease.kind, lease.conn.name, lease.conn.pid, self.config.daemon.lease_s)
            end_lease(self.cache, lease, commit=False)
            lease.conn.closed = True
            shutdown_socket(lease.conn.sock)
        return len(expired)
