"""The ectier cache daemon: one process per node that owns the host and NVMe tiers.

Clients (vLLM engines: an encoder instance that produces, prefill/decode instances that consume)
connect over a Unix socket and speak :mod:`ectier.daemon.protocol`. Tensor bytes move through the
host arena, a file in ``daemon.shm_dir`` that the daemon and every client map: a put reserves
arena blocks, the client copies into them and commits; a get pins an entry's blocks under a lease,
the client copies out and releases.

Threads: the accept loop runs in the caller's thread (:meth:`DaemonServer.serve_forever`); each
connection gets a thread; one reaper thread expires leases; the ``prefetch`` op's promotions run
in worker threads (:mod:`ectier.daemon.prefetch`), so no request waits on NVMe I/O for another
client's sake. The daemon is a thin shell around :class:`~ectier.cache.TieredCache`, which is
thread-safe. Requests are answered by :mod:`ectier.daemon.handlers`; the lease records live in
:mod:`ectier.daemon.leases`.

Connections: ``hello`` must be a connection's first request (any other op before it is refused
with a ``ProtocolError``, so no client skips the version check); a connection that sends nothing
for ``daemon.idle_timeout_s`` while holding no lease is closed; when the daemon is full
(``daemon.max_clients``, ``daemon.max_clients_per_uid``) a new connection takes the place of an
idle one (:mod:`ectier.daemon.connections`).

Leases: every reservation and read lease belongs to a connection and has a deadline
(``daemon.lease_s``). A disconnect (including a client killed with ``kill -9``) releases all of its
leases at once; a live client that overruns a deadline loses the lease (its commit fails, its
release reports the copy invalid) and its connection is closed. ``contains`` never renews a lease.
The exception: the *process-held* read leases under clients' zero-copy views (``get`` with
``hold``, ``prefetch`` with ``pin``) belong to the client process, have no deadline and outlive
its connections; they end on release or when the process exits (:mod:`ectier.daemon.holders`).
"""

from __future__ import annotations

import fcntl
import grp
import logging
import os
import pwd
import signal
import socket
import threading
import time
from typing import Any

from .. import __version__
from ..cache import TieredCache
from ..config import CacheConfig
from ..errors import EctierError
from .connections import Connection, admission, peer_credentials
from .files import claim_socket_path, reclaim_stale_arenas
from .handlers import handle
from .holders import Holders
from .leases import LeaseBook, end_lease
from .prefetch import Prefetcher
from .protocol import FrameDecoder, ProtocolError, encode_frame, error_reply

__all__ = ["DaemonServer", "run_daemon"]

log = logging.getLogger("ectier.daemon")


class DaemonServer:
    """Serve a :class:`TieredCache` over a Unix socket (see the module docstring).

    Args:
        config: the whole :class:`~ectier.config.CacheConfig`; ``config.daemon`` configures the
            socket, ``host``/``nvme`` the tiers.

    Raises (from :meth:`start`):
        EctierError: the socket path is in use by a live daemon, or cannot be bound.
        StoreOpenError, StoreLockedError: from the NVMe tier.
    """

    def __init__(self, config: CacheConfig) -> None:
        if config.host.capacity_bytes == 0:
            raise EctierError("host.capacity_bytes: the daemon moves bytes through the host arena; it must be > 0")
        if config.gpu.enabled:
            raise EctierError(
                "gpu.capacity_bytes: the daemon has no GPU tier (a GPU tier lives in the worker process that "
                "owns the device); set it to 0 in the daemon's config"
            )
        self.config = config
        self.socket_path = config.daemon.resolved_socket_path()
        # absolute: clients open the path the daemon sends them, from their own working directory
        self.arena_path = os.path.join(
            os.path.abspath(config.daemon.shm_dir), f"ectier-{os.getuid()}-{os.getpid()}.arena"
        )
        self.cache: TieredCache | None = None
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: dict[int, Connection] = {}
        self._next_id = 1  # of the next connection or lease
        self.leases = LeaseBook(self._lock, config.daemon.lease_s, self._new_id_locked)
        view_bytes = config.daemon.view_pin_bytes
        self.holders = Holders(config.host.capacity_bytes // 2 if view_bytes is None else view_bytes)
        #: names this daemon run in ``hello`` (a client drops releases of leases an earlier run granted)
        self.instance = os.urandom(8).hex()
        self._threads: list[threading.Thread] = []
        self.allowed_gid = self._resolve_group(config.daemon.allowed_group)
        self.prefetcher: Prefetcher | None = None
        self._metrics_server = None
        self.metrics_address: tuple[str, int] | None = None  # (host, bound port) when metrics are on
        self._arena_lock_fd: int | None = None
        self.counters = {"connections": 0, "refused": 0, "protocol_errors": 0, "leases_expired": 0,
                         "idle_closed": 0, "evicted": 0}

    # --------------------------------------------------------------------------- lifecycle

    @staticmethod
    def _resolve_group(name: str | None) -> int | None:
        if name is None:
            return None
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            raise EctierError(f"daemon.allowed_group: no group named {name!r} on this machine") from None

    def use_cache(self, cache: TieredCache) -> None:
        """Serve ``cache`` (opened by :meth:`start`; the protocol fuzzer hands its own to call the
        handlers without a socket), with the prefetcher of the ``prefetch`` op."""
        self.cache = cache
        self.prefetcher = Prefetcher(cache, hold_s=self.config.daemon.lease_s,
                                     scratch_dir=self.config.daemon.shm_dir, gid=self.allowed_gid)

    def start(self) -> None:
        """Open the tiers, bind the socket, start the reaper (and metrics). Returns at once."""
        claim_socket_path(self.socket_path)
        self._open_arena()
        try:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old_umask = os.umask(0o177)
            try:
                listener.bind(self.socket_path)
            finally:
                os.umask(old_umask)
            os.chmod(self.socket_path, self.config.daemon.socket_mode_bits)
            if self.allowed_gid is not None:
                os.chown(self.socket_path, -1, self.allowed_gid)
                os.chown(self.arena_path, -1, self.allowed_gid)
                os.chmod(self.arena_path, 0o660)
            listener.listen(128)
            listener.settimeout(0.2)
        except OSError as exc:
            self._abort_start()
            raise EctierError(f"daemon.socket_path: cannot listen on {self.socket_path!r}: {exc.strerror}") from None
        if self.config.daemon.metrics_port is not None:
            from .metrics import start_metrics_server

            try:
                self._metrics_server = start_metrics_server(self, self.config.daemon.metrics_host,
                                                            self.config.daemon.metrics_port)
            except OSError as exc:
                listener.close()
                self._abort_start(unlink_socket=True)
                raise EctierError(
                    f"daemon.metrics_port: cannot serve metrics on {self.config.daemon.metrics_host}:"
                    f"{self.config.daemon.metrics_port}: {exc.strerror or exc} (another daemon or exporter on "
                    f"that port? choose another daemon.metrics_port, or leave it unset to turn metrics off)"
                ) from None
            # metrics_port 0 binds an ephemeral port: say which (log and stats)
            self.metrics_address = (self.config.daemon.metrics_host, self._metrics_server.server_address[1])
        self._listener = listener
        reaper = threading.Thread(target=self._reap_loop, name="ectier-lease-reaper", daemon=True)
        reaper.start()
        self._threads.append(reaper)
        remote = self.config.remote
        log.info("ectier daemon %s listening on %s (arena %s, %d bytes; nvme %s; remote %s; metrics %s)", __version__,
                 self.socket_path, self.arena_path, self.config.host.capacity_bytes,
                 self.config.nvme.path or "off",
                 "off" if remote.backend == "none" else f"{remote.backend} at {remote.addresses or '-'}",
                 "http://%s:%d/metrics" % self.metrics_address if self.metrics_address else "off")

    def _abort_start(self, *, unlink_socket: bool = False) -> None:
        """Undo a start that failed after the arena was created: close the cache (which removes
        the arena file), drop the arena lock and (``unlink_socket``: a socket this daemon bound)
        the socket file, so nothing is left behind."""
        try:
            self.cache.close()
        finally:
            if self._arena_lock_fd is not None:
                os.close(self._arena_lock_fd)
                self._arena_lock_fd = None
            if unlink_socket:
                try:
                    os.unlink(self.socket_path)
                except FileNotFoundError:
                    pass

    def _open_arena(self) -> None:
        """Create the cache (and so the arena file) holding an flock on the arena for the daemon's
        lifetime; first remove arena files of this user's daemons that died without cleaning up
        (kill -9, OOM): each holds ``host.capacity_bytes`` of RAM in /dev/shm, and one carrying
        this process's own name (a restarted daemon that is PID 1 of its container) would make
        the arena creation fail. The shm directory is flock'ed meanwhile, so two daemons starting
        at once never take each other's fresh arena for a stale one."""
        shm_dir = self.config.daemon.shm_dir
        try:
            dir_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as exc:
            raise EctierError(f"daemon.shm_dir: cannot open {shm_dir!r}: {exc.strerror}") from None
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX)
            reclaim_stale_arenas(shm_dir)
            self.use_cache(TieredCache(self.config, host_shm_path=self.arena_path))
            self._arena_lock_fd = os.open(self.arena_path, os.O_RDONLY)
            fcntl.flock(self._arena_lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            fcntl.flock(dir_fd, fcntl.LOCK_UN)
            os.close(dir_fd)

    def serve_forever(self) -> None:
        """Accept connections until :meth:`stop` (or SIGTERM/SIGINT via :func:`run_daemon`)."""
        assert self._listener is not None, "call start() first"
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    break
                raise
            self._admit(sock)
        self._shutdown()

    def stop(self) -> None:
        """Ask the accept loop to finish; in-flight requests complete, then the cache is closed."""
        self._stop.set()

    def _shutdown(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=10)
        for lease in self.leases.take_all():
            end_lease(self.cache, lease, commit=False)
        with self._lock:
            self.holders.close_locked()
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self.cache is not None:
            self.cache.close()  # flushes host entries to NVMe when nvme.flush_on_close
        for path in (self.socket_path, self.arena_path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if self._arena_lock_fd is not None:
            os.close(self._arena_lock_fd)
            self._arena_lock_fd = None
        log.info("ectier daemon stopped")

    # ------------------------------------------------------------------------- connections

    def _new_id_locked(self) -> int:
        """A fresh id for a connection or a lease (one counter: an id names one thing)."""
        new_id = self._next_id
        self._next_id += 1
        return new_id

    def _admit(self, sock: socket.socket) -> None:
        pid, uid, gid = peer_credentials(sock)
        victim = None
        if not self._peer_allowed(uid, gid):
            reason = f"uid {uid} is not allowed (daemon runs as uid {os.getuid()}; see daemon.allowed_group)"
        else:
            # a connection still answering its last request becomes idle a moment later: at the cap,
            # look again for up to ~0.1 s before refusing while some connection is busy
            for _ in range(6):
                with self._lock:
                    victim, reason = admission(self._conns.values(), uid, max_clients=self.config.daemon.max_clients,
                                               max_per_uid=self.config.daemon.uid_connection_cap)
                    if reason is None:
                        if victim is not None:  # idle: no request in progress, no lease; see admission()
                            victim.closed = True
                            self.counters["evicted"] += 1
                        conn = Connection(self._new_id_locked(), sock, pid, uid, gid)
                        self._conns[conn.id] = conn
                        self.counters["connections"] += 1
                        break
                    busy = any(c.busy for c in self._conns.values())
                if not busy:
                    break
                time.sleep(0.02)
        if reason is not None:
            self.counters["refused"] += 1
            log.warning("refused connection from pid %d: %s", pid, reason)
            try:
                sock.sendall(encode_frame(error_reply(None, "PermissionError", reason)))
            except OSError:
                pass
            sock.close()
            return
        if victim is not None:
            log.info("closed the idle connection of client %s (pid %d, uid %d; idle %.1f s) to make room for "
                     "pid %d (daemon.max_clients=%d, daemon.max_clients_per_uid=%d)", victim.name, victim.pid,
                     victim.uid, time.monotonic() - victim.last_active, pid, self.config.daemon.max_clients,
                     self.config.daemon.uid_connection_cap)
            _shutdown(victim.sock)
        t = threading.Thread(target=self._serve_connection, args=(conn,), name=f"ectier-conn-{conn.id}", daemon=True)
        self._threads = [x for x in self._threads if x.is_alive()]
        self._threads.append(t)
        t.start()

    def _peer_allowed(self, uid: int, gid: int) -> bool:
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
                try:
                    self._serve_data(conn, decoder, data)
                finally:
                    with self._lock:
                        conn.busy = False
                        conn.last_active = time.monotonic()
                if conn.closed:
                    break
        finally:
            self._disconnect(conn)

    def _serve_data(self, conn: Connection, decoder: FrameDecoder, data: bytes) -> None:
        """Answer every request completed by ``data``; a lost framing closes the connection."""
        try:
            messages = decoder.feed(data)
        except ProtocolError as exc:  # framing lost: answer once, then drop this client
            self.counters["protocol_errors"] += 1
            self._send(conn, error_reply(None, "ProtocolError", str(exc)))
            conn.closed = True
            return
        for msg in messages:
            conn.granted_now = []
            reply = self._handle(conn, msg)
            if not self._send(conn, reply):
                self._revoke(conn, conn.granted_now)
                conn.closed = True
                return

    def _revoke(self, conn: Connection, lease_ids: list[int]) -> None:
        """End the process-held leases granted by a request whose reply never reached its client."""
        for lease_id in lease_ids:
            lease = self.leases.take(conn, lease_id, "get")
            if lease is not None:
                end_lease(self.cache, lease, commit=False)
        if lease_ids:
            log.info("client %s (pid %d) went away before the reply granting %d view lease(s); revoked",
                     conn.name, conn.pid, len(lease_ids))

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
        for lease in leases:
            end_lease(self.cache, lease, commit=False)
        try:
            conn.sock.close()
        except OSError:
            pass
        if leases:
            log.info("client %s (pid %d) disconnected holding %d lease(s); reclaimed", conn.name, conn.pid, len(leases))

    # ------------------------------------------------------------------------------ requests

    def _handle(self, conn: Connection, msg: dict[str, Any] | ProtocolError) -> dict[str, Any]:
        """The reply to one request of ``conn`` (:func:`ectier.daemon.handlers.handle`)."""
        return handle(self, conn, msg)

    def stats(self) -> dict[str, Any]:
        """The cache's stats plus daemon facts: socket, arena, clients, leases, counters."""
        assert self.cache is not None
        out = self.cache.stats()
        with self._lock:
            now = time.time()
            out["daemon"] = {
                "socket": self.socket_path,
                "arena": self.arena_path,
                "metrics": ({"host": self.metrics_address[0], "port": self.metrics_address[1]}
                            if self.metrics_address else None),
                "leases": self.leases.counts_locked(),
                "views": {**self.leases.held_counts_locked(), "limit_bytes": self.holders.limit_bytes,
                          **self.holders.counters},
                "prefetch": self.prefetcher.stats() if self.prefetcher is not None else {},
                "clients": [
                    {"id": c.id, "name": c.name, "pid": c.pid, "uid": c.uid, "connected_s": round(now - c.since, 3),
                     "requests": c.requests, "leases": len(c.leases)}
                    for c in self._conns.values() if not c.closed
                ],
                **self.counters,
            }
        return out

    # ------------------------------------------------------------------------ lease expiry

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
        with self._lock:
            reason = self.holders.refusal_locked(conn.pid, self.leases.held_bytes_locked(conn.pid),
                                                 self.leases.held_bytes_locked(conn.pid, also=handle))
            if reason is not None:
                self.holders.counters["refused"] += 1
                return None, reason
            self.holders.counters["granted"] += 1
            lease_id = self.leases.grant_held_locked(conn.pid, handle)
            conn.granted_now.append(lease_id)
            return lease_id, None

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
            _shutdown(lease.conn.sock)
        return len(expired)


def _shutdown(sock: socket.socket) -> None:
    """Wake the connection's thread (its recv returns) so that it disconnects."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def run_daemon(config: CacheConfig) -> int:
    """Run a daemon in the foreground until SIGTERM/SIGINT; returns the exit code (0)."""
    server = DaemonServer(config)

    def _on_signal(signum: int, frame: object) -> None:
        log.info("received %s; finishing in-flight requests", signal.Signals(signum).name)
        server.stop()

    # before start(): a SIGTERM that arrives once the socket exists must still clean up
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.start()
        server.serve_forever()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
