"""The daemon's connections: admission, one thread per connection reading and answering its
requests, and what a disconnect ends (a mixin of :class:`~ectier.daemon.server.DaemonServer`).

Admission (:meth:`ConnectionServing._admit`): the peer's credentials (``SO_PEERCRED``) against
``daemon.allowed_group`` (:meth:`ConnectionServing.peer_allowed`), then
:func:`ectier.daemon.connections.admission` under the server's lock (an idle connection may be
closed to make room), at most ``daemon.max_clients`` connections
or fewer where ``RLIMIT_NOFILE`` keeps descriptors back for the daemon
(:func:`ectier.daemon.fdlimit.client_cap`). Each admitted connection is served by a
thread of its own (:meth:`ConnectionServing._serve_connection`): frames are decoded and each
request is answered by :func:`ectier.daemon.handlers.handle`; a reply that cannot be sent revokes
the process-held leases its request granted; a connection idle for ``daemon.idle_timeout_s``
without a lease is closed; a disconnect ends every lease of the connection. Connection threads
run under ``SCHED_BATCH`` (:func:`batch_scheduling`): no wake-up preemption of their clients.
Out of descriptors at ``accept`` (:meth:`ConnectionServing._accept_failed`), the least recently
used idle connection is closed to make room, as at ``daemon.max_clients``.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import socket
import threading
import time
from typing import Any

from .connections import Connection, admission, least_recently_used_idle, peer_credentials
from .holders import process_start
from .handlers import handle
from .leases import end_lease
from .protocol import FrameDecoder, ProtocolError, encode_frame, error_reply

__all__ = ["ConnectionServing", "batch_scheduling", "shutdown_socket"]

log = logging.getLogger("ectier.daemon")


class ConnectionServing:
    """The connection threads of :class:`~ectier.daemon.server.DaemonServer` (module docstring);
    uses its ``config``, ``_lock``, ``_conns``, ``leases``, ``cache``, ``counters``, ``_stop``."""

    def count(self, name: str, n: int = 1, *, of: dict | None = None) -> None:
        """Add ``n`` to counter ``name`` of ``of`` (default: the server's ``counters``) under the
        server's lock (connection threads count concurrently: ``+=`` on a dict item is a
        read-modify-write that can lose increments)."""
        with self._lock:
            (self.counters if of is None else of)[name] += n

    def _admit(self, sock: socket.socket) -> None:
        pid, uid, gid = peer_credentials(sock)
        pid_start = process_start(pid) if pid > 0 else None
        victim = None
        if not self.peer_allowed(uid, gid):
            reason = f"uid {uid} is not allowed (daemon runs as uid {os.getuid()}; see daemon.allowed_group)"
        else:
            # a connection still answering its last request becomes idle a moment later: at the cap,
            # look again for up to ~0.1 s before refusing while some connection is busy
            for _ in range(6):
                with self._lock:
                    victim, reason = admission(self._conns.values(), uid, max_clients=self.client_cap.limit,
                                               max_per_uid=self.config.daemon.uid_connection_cap,
                                               cap_note=self.client_cap.note)
                    if reason is None:
                        if victim is not None:  # idle: no request in progress, no lease; see admission()
                            victim.closed = True  # (a request it receives now is dropped)
                            # counted here, before the newcomer's thread can answer a stats request
                            self.counters["evicted"] += 1
                        conn = Connection(self._new_id_locked(), sock, pid, uid, gid, pid_start=pid_start)
                        self._conns[conn.id] = conn
                        self.counters["connections"] += 1
                        break
                    busy = any(c.busy for c in self._conns.values())
                if not busy:
                    break
                time.sleep(0.02)
        if reason is not None:
            self.count("refused")
            log.warning("refused connection from pid %d: %s", pid, reason)
            try:
                sock.sendall(encode_frame(error_reply(None, "PermissionError", reason)))
            except OSError:
                pass
            sock.close()
            return
        t = threading.Thread(target=self._serve_connection, args=(conn,), name=f"ectier-conn-{conn.id}", daemon=True)
        try:
            t.start()
        except RuntimeError as exc:  # no thread (pids limit, memory): refuse this client, serve the others
            with self._lock:
                self._conns.pop(conn.id, None)
                conn.closed = True
                if victim is not None:
                    self.counters["evicted"] -= 1
                    if victim.id in self._conns:
                        victim.closed = False  # it keeps its place: the newcomer did not take it
                self.counters["refused"] += 1
            self._accept_log.warning(("thread",), "refused connection from pid %d: cannot start its thread (%s)",
                                     pid, exc)
            try:
                sock.sendall(encode_frame(error_reply(None, "OSError", f"the daemon cannot start a thread: {exc}")))
            except OSError:
                pass
            sock.close()
            return
        if victim is not None:
            self._close_victim(victim, pid)
        self._threads = [x for x in self._threads if x.is_alive()]
        self._threads.append(t)

    def _close_victim(self, victim: Connection, pid: int) -> None:
        """Close the idle connection ``victim`` whose place the client of ``pid`` took (counted
        in ``evicted`` at admission)."""
        log.info("closed the idle connection of client %s (pid %d, uid %d; idle %.1f s) to make room for "
                 "pid %d (%s, daemon.max_clients_per_uid=%d)", victim.name, victim.pid,
                 victim.uid, time.monotonic() - victim.last_active, pid, self.client_cap.note,
                 self.config.daemon.uid_connection_cap)
        shutdown_socket(victim.sock)

    def _accept_failed(self, exc: OSError) -> None:
        """``accept`` failed for want of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM):
        log it (one line per 10 s), close the least recently used idle connection if there is
        one (it loses nothing, see :mod:`ectier.daemon.connections`), and back off 20 ms so that
        its descriptor is freed and the loop never spins. Never raises."""
        with self._lock:
            victim = least_recently_used_idle(self._conns.values())
            if victim is not None:
                victim.closed = True
                self.counters["evicted"] += 1
            open_conns = sum(not c.closed for c in self._conns.values())
        self._accept_log.warning(
            ("accept", exc.errno), "cannot accept a connection: %s (%d connections open, %s, "
            "RLIMIT_NOFILE %s); %s; see docs/operations.md, Under systemd (LimitNOFILE=)",
            exc.strerror or exc, open_conns, self.client_cap.note, _nofile_limit(),
            f"closed the idle connection of client {victim.name or '(no hello yet)'} (pid {victim.pid}) to make room"
            if victim is not None else "no idle connection to close; retrying")
        if victim is not None:
            shutdown_socket(victim.sock)
        self._stop.wait(0.02)

    def peer_allowed(self, uid: int, gid: int) -> bool:
        """Whether a client process running as user ``uid`` with primary group ``gid`` (its
        ``SO_PEERCRED`` credentials) may connect: the daemon's own user always; with
        ``daemon.allowed_group`` also a process whose primary group is that group, or whose user
        (looked up by ``uid``; an unknown ``uid`` is no member) is a supplementary member of it
        (``/etc/group``). Without ``allowed_group``, no other user.

        Raises:
            KeyError: the allowed group no longer exists (removed since the daemon started)."""
        if uid == os.getuid():
            return True
        if self.allowed_gid is None:
            return False
        if gid == self.allowed_gid:
            return True
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            return False
        return user in grp.getgrgid(self.allowed_gid).gr_mem

    def _serve_connection(self, conn: Connection) -> None:
        decoder = FrameDecoder(self.config.daemon.max_frame_bytes)
        sock = conn.sock
        idle_timeout = self.config.daemon.idle_timeout_s
        batch_scheduling()
        try:
            sock.settimeout(idle_timeout if idle_timeout > 0 else None)
            while not self._stop.is_set():
                try:
                    data = sock.recv(65536)
                except socket.timeout:
                    if self._close_if_idle(conn):
                        break
                    continue
                except OSError:
                    break
                with self._lock:  # closed meanwhile (to make room, lease expiry): drop the request
                    if conn.closed or not data:
                        break
                    conn.busy = True
                    # stamped before the reply goes out, so a client's next move (another
                    # connection, say) is always later than this one's last request
                    conn.last_active = time.monotonic()
                try:
                    self._serve_data(conn, decoder, data)
                finally:
                    with self._lock:
                        conn.busy = False
                if conn.closed:
                    break
        finally:
            self._disconnect(conn)

    def _serve_data(self, conn: Connection, decoder: FrameDecoder, data: bytes) -> None:
        """Answer every request completed by ``data``; a lost framing closes the connection."""
        try:
            messages = decoder.feed(data)
        except ProtocolError as exc:
            self._framing_lost(conn, exc)
            return
        for msg in messages:
            conn.granted_now = []
            reply = handle(self, conn, msg)
            if not reply.get("ok", True):  # an error reply names no lease: the client never learns of them
                self._revoke(conn, conn.granted_now)
            if not self._send(conn, reply):
                self._revoke(conn, conn.granted_now)
                conn.closed = True
                return
        if decoder.fatal is not None:  # the requests before the bad frame were answered first
            self._framing_lost(conn, decoder.fatal)

    def _framing_lost(self, conn: Connection, exc: ProtocolError) -> None:
        """Answer once (id null), then drop this client: its stream cannot be read further."""
        self.count("protocol_errors")
        self._send(conn, error_reply(None, "ProtocolError", str(exc)))
        conn.closed = True

    def _revoke(self, conn: Connection, lease_ids: list[int]) -> None:
        """End the process-held leases and the put reservations granted by a request whose reply
        does not name them (an error reply) or never reached its client: it never learnt of them,
        so it writes nothing into a reservation (no orphan)."""
        revoked = 0
        for lease_id in lease_ids:
            lease = self.leases.take(conn, lease_id, "get") or self.leases.take(conn, lease_id, "put")
            if lease is not None:
                end_lease(self.cache, lease, commit=False)
                revoked += 1
        if revoked:
            log.info("client %s (pid %d): %d lease(s) granted by a request that failed or whose reply was "
                     "not delivered; revoked", conn.name, conn.pid, revoked)
        lease_ids.clear()

    def _close_if_idle(self, conn: Connection) -> bool:
        """After ``daemon.idle_timeout_s`` without a request: close ``conn`` unless it holds a
        lease (lease expiry takes care of those). Returns True if it is to be closed."""
        with self._lock:
            if conn.leases or conn.closed:
                return conn.closed
            conn.closed = True
            self.counters["idle_closed"] += 1
        log.debug("closed the connection of client %s (pid %d): no request for daemon.idle_timeout_s=%g s",
                  conn.name, conn.pid, self.config.daemon.idle_timeout_s)
        return True

    def _send(self, conn: Connection, reply: dict[str, Any]) -> bool:
        try:
            conn.sock.sendall(encode_frame(reply, max_frame_bytes=1 << 30))
            return True
        except OSError:
            return False

    def _disconnect(self, conn: Connection) -> None:
        with self._lock:
            self._conns.pop(conn.id, None)
            leases = self.leases.take_of_locked(conn)
            conn.closed = True
            ending = self.keep_or_end_locked(leases)  # (a live process's arena puts: orphans)
        for lease in ending:
            end_lease(self.cache, lease, commit=False)
        try:
            conn.sock.close()
        except OSError:
            pass
        if leases:
            log.info("client %s (pid %d) disconnected holding %d lease(s); %d reclaimed, %d kept as orphaned "
                     "put reservations (their process lives on)", conn.name, conn.pid, len(leases), len(ending),
                     len(leases) - len(ending))


def batch_scheduling() -> None:
    """Run the calling thread under ``SCHED_BATCH`` (Linux; elsewhere nothing): a request's
    arrival then wakes it without preempting the client that sent it (a vLLM scheduler step
    goes on while the daemon answers; measured in docs/benchmarks.md, daemon mode). Same
    priority otherwise; a refusal is ignored."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def _nofile_limit() -> str:
    """The soft RLIMIT_NOFILE, for a log line ("?" where there is none)."""
    try:
        import resource

        return str(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    except (ImportError, OSError, ValueError):
        return "?"


def shutdown_socket(sock: socket.socket) -> None:
    """Wake the connection's thread (its recv returns) so that it disconnects."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
