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
thread-safe. This module holds the lifecycle (start, arena, accept loop, shutdown) and the stats;
the connection threads are :mod:`ectier.daemon.serving`, requests are answered by
:mod:`ectier.daemon.handlers`, the lease records live in :mod:`ectier.daemon.leases` and their
expiry and the view grants in :mod:`ectier.daemon.upkeep`.

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

import errno
import fcntl
import grp
import logging
import os
import signal
import socket
import threading
import time
from dataclasses import replace
from typing import Any

from .. import __version__
from ..cache import TieredCache
from ..config import CacheConfig
from ..config_checks import view_pin_bounds
from ..errors import EctierError
from ..logutil import RateLimitedLogger
from .connections import Connection
from .fdlimit import ACCEPT_RESOURCE_ERRNOS, ClientCap, client_cap, raise_nofile_limit
from ..tiers.storedir import MEMORY_FS_TYPES, mount_of
from .files import claim_socket_path, reclaim_stale_arenas, remove_created_dirs
from .holders import Holders
from .leases import LeaseBook, end_lease
from .prefetch import Prefetcher
from .serving import ConnectionServing
from .upkeep import LeaseUpkeep

__all__ = ["DaemonServer", "run_daemon", "unpinned", "view_pin_bounds"]

#: filesystems whose files live in memory (``daemon.shm_dir`` belongs on one)

log = logging.getLogger("ectier.daemon")


def unpinned(config: CacheConfig) -> CacheConfig:
    """``config`` with ``host.pin_memory`` false: the daemon never page-locks its arena.

    ``cudaHostRegister`` serves only the process that calls it (each client registers its own
    mapping of the arena, :meth:`~ectier.daemon.client.DaemonClient.put`), and would open a CUDA
    context here: GPU memory on device 0 taken from the engines' budget, for nothing. A config
    asking for it is told so once (INFO), not refused (docs/operations.md, ``host.pin_memory``)."""
    if config.host.pin_memory:
        log.info("host.pin_memory: the daemon does not page-lock its arena (each client page-locks its own "
                 "mapping of it); the setting is not used here")
    return config.replace(host=replace(config.host, pin_memory=False))


class DaemonServer(ConnectionServing, LeaseUpkeep):
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
        #: the connections admitted: daemon.max_clients, or fewer by RLIMIT_NOFILE (set by start())
        self.client_cap = ClientCap(config.daemon.max_clients, config.daemon.max_clients, None)
        self._next_id = 1  # of the next connection or lease
        self.leases = LeaseBook(self._lock, config.daemon.lease_s, self._new_id_locked,
                                block_bytes=config.host.block_bytes)
        self.holders = Holders(*view_pin_bounds(config))
        #: names this daemon run in ``hello`` (a client drops releases of leases an earlier run granted)
        self.instance = os.urandom(8).hex()
        self._threads: list[threading.Thread] = []
        self._accept_log = RateLimitedLogger(log, 10.0)  # accept() out of descriptors: one line per 10 s
        self.allowed_gid = self._resolve_group(config.daemon.allowed_group)
        self.prefetcher: Prefetcher | None = None
        self._metrics_server = None
        self.metrics_address: tuple[str, int] | None = None  # (host, bound port) when metrics are on
        self._arena_lock_fd: int | None = None
        self._created_dirs: list[str] = []  # by claim_socket_path; removed again if start fails
        self.counters = {"connections": 0, "refused": 0, "protocol_errors": 0, "leases_expired": 0,
                         "idle_closed": 0, "evicted": 0, "orphans": 0, "orphans_ended": 0}

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
        """Start the metrics endpoint, open the tiers, bind the socket, start the reaper. Returns
        at once. Raises the soft ``RLIMIT_NOFILE`` first where ``daemon.max_clients`` needs it
        (:mod:`ectier.daemon.fdlimit`), and admits at most that limit less ``FD_MARGIN`` client
        connections (:func:`~ectier.daemon.fdlimit.client_cap`). A start that fails leaves nothing
        it made behind (the socket path is claimed first, then the metrics port: a port in use fails
        before the arena or the NVMe store is created).

        Raises:
            EctierError: naming the knob at fault (``daemon.metrics_port``/``metrics_host``,
                ``daemon.socket_path``, ``daemon.shm_dir``, ...)."""
        max_clients = self.config.daemon.max_clients
        self.client_cap = client_cap(max_clients, raise_nofile_limit(max_clients))
        self._created_dirs = claim_socket_path(self.socket_path)  # (first: "a daemon is already listening")
        try:
            self._start_metrics()
            self._open_arena()
            self._listener = self._listen()  # (undoes the arena itself when it fails)
        except BaseException:
            self._stop_metrics()
            remove_created_dirs(self._created_dirs)
            raise
        reaper = threading.Thread(target=self._reap_loop, name="ectier-lease-reaper", daemon=True)
        reaper.start()
        self._threads.append(reaper)
        remote = self.config.remote
        log.info("ectier daemon %s listening on %s (arena %s, %d bytes; nvme %s; remote %s; metrics %s)", __version__,
                 os.path.abspath(self.socket_path), self.arena_path, self.config.host.capacity_bytes,
                 os.path.abspath(self.config.nvme.path) if self.config.nvme.path else "off",
                 "off" if remote.backend == "none" else f"{remote.backend} at {remote.addresses or '-'}",
                 "http://%s:%d/metrics" % self.metrics_address if self.metrics_address else "off")

    def _start_metrics(self) -> None:
        """Serve ``/metrics`` when ``daemon.metrics_port`` is set (empty until the cache is open)."""
        if self.config.daemon.metrics_port is None:
            return
        from .metrics import start_metrics_server

        try:
            self._metrics_server = start_metrics_server(self, self.config.daemon.metrics_host,
                                                        self.config.daemon.metrics_port)
        except OSError as exc:
            raise EctierError(_metrics_bind_error(self.config.daemon, exc)) from None
        # metrics_port 0 binds an ephemeral port: say which (log and stats)
        self.metrics_address = (self.config.daemon.metrics_host, self._metrics_server.server_address[1])

    def _stop_metrics(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None

    def _listen(self) -> socket.socket:
        """The listening socket at ``daemon.socket_path`` (mode, group); on failure the start is
        undone (:meth:`_abort_start`) and EctierError names ``daemon.socket_path``."""
        listener, bound = None, False
        try:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old_umask = os.umask(0o177)
            try:
                listener.bind(self.socket_path)
                bound = True
            finally:
                os.umask(old_umask)
            mode = self.config.daemon.socket_mode_bits
            if self.allowed_gid is not None:
                mode |= 0o060  # the group's members must be able to connect (docs/operations.md, Security)
            os.chmod(self.socket_path, mode)
            if self.allowed_gid is not None:
                os.chown(self.socket_path, -1, self.allowed_gid)
                os.chown(self.arena_path, -1, self.allowed_gid)
                os.chmod(self.arena_path, 0o660)
            listener.listen(128)
            listener.settimeout(0.2)
            return listener
        except OSError as exc:
            if listener is not None:
                listener.close()
            self._abort_start(unlink_socket=bound)
            raise EctierError(f"daemon.socket_path: cannot listen on {self.socket_path!r}: {exc.strerror}") from None

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
        mount = mount_of(shm_dir)
        if mount is not None and mount.fstype not in MEMORY_FS_TYPES:
            log.warning("daemon.shm_dir %r is on a %s filesystem, not in memory: the arena (%d bytes) is a file the "
                        "kernel writes back to that disk; use a tmpfs such as /dev/shm", os.path.abspath(shm_dir),
                        mount.fstype, self.config.host.capacity_bytes)
        try:
            fcntl.flock(dir_fd, fcntl.LOCK_EX)
            reclaim_stale_arenas(shm_dir)
            self.use_cache(TieredCache(unpinned(self.config), host_shm_path=self.arena_path))
            self._arena_lock_fd = os.open(self.arena_path, os.O_RDONLY)
            fcntl.flock(self._arena_lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            fcntl.flock(dir_fd, fcntl.LOCK_UN)
            os.close(dir_fd)

    def serve_forever(self) -> None:
        """Accept connections until :meth:`stop` (or SIGTERM/SIGINT/SIGHUP via :func:`run_daemon`), then
        shut down (also when this raises: the cache is flushed and the socket file removed).

        Out of descriptors or memory at ``accept`` (EMFILE, ENFILE, ENOBUFS, ENOMEM) the daemon
        goes on serving: it logs (rate-limited), closes the least recently used idle connection,
        if any, and backs off briefly (:meth:`_accept_failed`).

        Raises:
            OSError: ``accept`` failed otherwise (the listener is broken)."""
        assert self._listener is not None, "call start() first"
        try:
            while not self._stop.is_set():
                try:
                    sock, _ = self._listener.accept()
                except socket.timeout:
                    continue
                except OSError as exc:
                    if self._stop.is_set():
                        break
                    if exc.errno in ACCEPT_RESOURCE_ERRNOS:
                        self._accept_failed(exc)
                        continue
                    if exc.errno in (errno.ECONNABORTED, errno.EPROTO):  # the peer left meanwhile
                        continue
                    raise
                self._admit(sock)
        finally:
            self._stop.set()  # (when this raised: the reaper and the other threads stop too)
            self._shutdown()

    def stop(self) -> None:
        """Ask the accept loop to finish; in-flight requests complete, then the cache is closed."""
        self._stop.set()

    @property
    def listening(self) -> bool:
        """Whether the daemon holds its listening socket: True from a :meth:`start` that
        succeeded until the shutdown that ends :meth:`serve_forever`; False before, after, and
        after a failed start (which leaves nothing behind). A started daemon that is never served
        is shut down by :meth:`stop` then :meth:`serve_forever` (it returns at once)."""
        return self._listener is not None

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
        self._stop_metrics()
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

    # ------------------------------------------------------------------------------ requests

    def stats(self) -> dict[str, Any]:
        """The cache's stats plus daemon facts: socket, arena, clients, leases, counters."""
        assert self.cache is not None
        out = self.cache.stats()
        with self._lock:
            now = time.time()
            out["daemon"] = {
                "socket": os.path.abspath(self.socket_path),
                "arena": self.arena_path,
                "metrics": ({"host": self.metrics_address[0], "port": self.metrics_address[1]}
                            if self.metrics_address else None),
                "leases": self.leases.counts_locked(),
                "orphaned_puts": self.leases.orphan_counts_locked(),
                "views": {**self.leases.held_counts_locked(), "limit_bytes": self.holders.limit_bytes,
                          "total_limit_bytes": self.holders.total_limit_bytes,
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

def _metrics_bind_error(cfg: Any, exc: OSError) -> str:
    """The start-up error for a metrics endpoint that could not bind, naming the knob at fault:
    ``daemon.metrics_host`` for a name that does not resolve or an address this host does not
    have, else ``daemon.metrics_port`` (in use, or a privileged port)."""
    where = f"{cfg.metrics_host}:{cfg.metrics_port}"
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        return (f"daemon.metrics_host: cannot serve metrics on {where}: {exc.strerror or exc} (use an address "
                f"of this host, e.g. 127.0.0.1, or leave daemon.metrics_port unset to turn metrics off)")
    return (f"daemon.metrics_port: cannot serve metrics on {where}: {exc.strerror or exc} (another daemon or "
            f"exporter on that port? choose another daemon.metrics_port, or leave it unset to turn metrics off)")


def run_daemon(config: CacheConfig) -> int:
    """Run a daemon in the foreground until SIGTERM, SIGINT or SIGHUP (unless ignored, as under
    ``nohup``), each a clean stop (requests in flight finished, host entries flushed when
    ``nvme.flush_on_close``, socket and arena removed); returns the exit code (0)."""
    server = DaemonServer(config)

    def _on_signal(signum: int, frame: object) -> None:
        log.info("received %s; finishing in-flight requests", signal.Signals(signum).name)
        server.stop()

    # before start(): a SIGTERM that arrives once the socket exists must still clean up
    # SIGHUP too: the terminal or ssh session of a foreground `ectier serve` closed (its default
    # ends the process with no flush: write-back entries only in the arena were lost), unless it
    # is ignored (`nohup ectier serve`: it is to outlive the session)
    stops = (signal.SIGTERM, signal.SIGINT) + (() if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
                                               else (signal.SIGHUP,))
    previous = {sig: signal.signal(sig, _on_signal) for sig in stops}
    try:
        server.start()
        server.serve_forever()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
