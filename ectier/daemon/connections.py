"""The daemon's client connections: their state, and who gets a slot when the daemon is full.

Admission rule (:func:`admission`), checked under the server's lock for every new connection of
user ``uid`` (peer credentials from ``SO_PEERCRED``):

1. ``uid`` already holds ``daemon.max_clients_per_uid`` live connections: the least recently used
   *idle* one of them (no request in progress, no lease) is closed to make room; with none idle
   the new connection is refused.
2. Otherwise, the daemon holds ``daemon.max_clients`` live connections (fewer where
   ``RLIMIT_NOFILE`` less the descriptors the daemon keeps for itself allows fewer:
   :func:`ectier.daemon.fdlimit.client_cap`): the least recently used
   idle connection of the user with the most connections is closed (the next user's if that one
   has none idle, and so on); with none idle anywhere the new connection is refused.

Closing an idle connection loses nothing: it holds no lease and is between requests, and
:class:`~ectier.daemon.client.DaemonClient` replaces a closed connection before its next call.
So connections left open by idle clients never lock new clients out; only connections that are
working (a request in progress or a lease held) count against the caps for good.
"""

from __future__ import annotations

import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

__all__ = ["Connection", "admission", "least_recently_used_idle", "peer_credentials"]

_PEERCRED = struct.Struct("3i")  # pid, uid, gid (struct ucred)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid, gid


@dataclass(eq=False)
class Connection:
    """One client connection. Fields other than ``sock`` and the credentials are guarded by the
    server's lock: ``greeted`` (a ``hello`` succeeded), ``busy`` (a request is being handled),
    ``last_active`` (monotonic seconds when its last request arrived, or of the connect), ``closed``."""

    id: int
    sock: socket.socket
    pid: int
    uid: int
    gid: int
    name: str = ""
    #: when the peer process started (:func:`~ectier.daemon.holders.process_start`, read at
    #: connect): the pid with it names one process across pid reuse; None where unreadable
    pid_start: int | None = None
    #: the client said ``bye``: it writes into none of this connection's put reservations any
    #: more, so at its close they end instead of becoming orphans (:mod:`ectier.daemon.leases`)
    writes_over: bool = False
    since: float = field(default_factory=time.time)
    leases: set[int] = field(default_factory=set)
    requests: int = 0
    closed: bool = False
    greeted: bool = False
    busy: bool = False
    last_active: float = field(default_factory=time.monotonic)
    #: process-held leases granted while answering the current request: revoked if its reply
    #: cannot be sent (the client gave up waiting and closed), or nobody would ever release them
    granted_now: list[int] = field(default_factory=list)

    @property
    def idle(self) -> bool:
        """Between requests and holding no lease: closing it loses nothing."""
        return not self.closed and not self.busy and not self.leases


def least_recently_used_idle(conns: Iterable[Connection]) -> Connection | None:
    """The idle connection (:attr:`Connection.idle`) of ``conns`` whose last request is oldest, or None."""
    idle = [c for c in conns if c.idle]
    return min(idle, key=lambda c: c.last_active) if idle else None


def admission(conns: Iterable[Connection], uid: int, *, max_clients: int,
              max_per_uid: int, cap_note: str | None = None) -> tuple[Connection | None, str | None]:
    """Decide on a new connection of ``uid`` (the module docstring's rule).

    ``max_clients`` is the number the daemon admits: ``daemon.max_clients``, or fewer where the
    descriptor limit lowers it (:func:`ectier.daemon.fdlimit.client_cap`; ``cap_note`` then names
    both for the refusal, default ``daemon.max_clients=<max_clients>``).

    Returns ``(victim, refusal)``: ``(None, None)`` = room, admit; ``(conn, None)`` = close
    ``conn`` (idle), then admit; ``(None, reason)`` = refuse, ``reason`` naming the knob.
    """
    live = [c for c in conns if not c.closed]
    mine = [c for c in live if c.uid == uid]
    if max_per_uid < max_clients and len(mine) >= max_per_uid:  # (equal caps: rule 2 says the same)
        victim = least_recently_used_idle(mine)
        if victim is None:
            return None, (f"too many connections of uid {uid} (daemon.max_clients_per_uid={max_per_uid}), "
                          "none of them idle")
        return victim, None
    if len(live) >= max_clients:
        for owner, _ in Counter(c.uid for c in live).most_common():
            victim = least_recently_used_idle(c for c in live if c.uid == owner)
            if victim is not None:
                return victim, None
        return None, f"too many clients ({cap_note or f'daemon.max_clients={max_clients}'}), none of them idle"
    return None, None
