"""The standalone daemon's section of the configuration (``CacheConfig.daemon``); re-exported by
:mod:`ectier.config`, whose docstring describes the whole tree."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .config_checks import MiB, check_daemon

__all__ = ["DaemonConfig"]


@dataclass(frozen=True)
class DaemonConfig:
    """The standalone cache daemon (``ectier serve``): socket, security, leases, metrics.

    Fields:
        socket_path: Unix socket to listen on. ``None`` (default) = ``$XDG_RUNTIME_DIR/ectier.sock``
            when that directory exists, else ``/tmp/ectier-<uid>.sock``. A missing parent
            directory is created by ``ectier serve``.
        socket_mode: permission bits of the socket file as an octal string (``"0600"``, ``"600"``,
            ``"0o600"``), default ``"0600"`` (owner only); with ``allowed_group`` the group's read
            and write bits are added (``"0600"`` becomes ``0660``). The owner's read and write bits
            are required and bits for other users refused (``"0644"``, ``"0666"``). Quote it in YAML: an unquoted ``600`` is the decimal number 600 and is refused
            (an int is taken as the mode's value: YAML's unquoted ``0600``, JSON's 384).
        allowed_group: name of a group whose members may connect besides the daemon's own user
            (checked with SO_PEERCRED on every connection). Default ``None``.
        shm_dir: directory of the shared host arena file that clients map; belongs on a tmpfs
            (one on a disk filesystem works, with a warning at start). Default ``/dev/shm``.
        lease_s: seconds a client holds a put reservation or a get lease before it expires and its
            arena space is reclaimed (a disconnect reclaims at once); a put reservation of a client
            process still alive keeps its blocks until that process aborts it or exits
            (docs/protocol.md, "Leases"). Default 30.
        max_frame_bytes: cap of one protocol frame (control messages only; tensor bytes move
            through shared memory). Default 1 MiB.
        max_clients: concurrent connections. Default 64. At the cap, a new connection takes the
            place of the least recently used idle one (no request in progress, no lease) of the
            user with the most connections; with none idle it is refused with an error reply.
            The daemon admits fewer where its soft ``RLIMIT_NOFILE`` less the 64 descriptors it
            keeps for itself is lower (logged at start; see ``LimitNOFILE``).
        max_clients_per_uid: concurrent connections of one user (uid); at the cap, a new one of
            that user takes the place of that user's least recently used idle connection, or is
            refused. ``None`` (default) = ``max_clients``; at most ``max_clients``.
        idle_timeout_s: seconds after which the daemon closes a connection that sent no request
            and holds no lease (clients reconnect by themselves); 0 = never. Default 300.
        metrics_port: serve Prometheus metrics on this TCP port; ``None`` (default) = off.
        metrics_host: address of the metrics endpoint. Default ``127.0.0.1``.
        view_pin_bytes: bytes of the host arena one client process may hold pinned under
            zero-copy views (process-held leases: no ``lease_s`` deadline, released when the view
            is freed or the process exits), each entry counted as the whole ``host.block_bytes``
            blocks it occupies (an 80 KB entry in 256 KiB blocks pins 256 KiB); a read beyond it is
            copied instead (counted as ``views.refused`` in ``ectier stats``). ``None`` (default) =
            half of ``host.capacity_bytes``; 0 = no views (every read copies). At most
            ``host.capacity_bytes``.
        view_pin_total_bytes: bytes of the host arena all client processes together may hold
            pinned under zero-copy views (summed over the processes; whole blocks, as
            ``view_pin_bytes``); a read beyond it is copied.
            ``None`` (default) = half of ``host.capacity_bytes``, or ``view_pin_bytes`` when that
            is larger. At least ``view_pin_bytes``, at most ``host.capacity_bytes``.
    """

    socket_path: str | None = None
    socket_mode: str = "0600"
    allowed_group: str | None = None
    shm_dir: str = "/dev/shm"
    lease_s: float = 30.0
    max_frame_bytes: int = 1 * MiB
    max_clients: int = 64
    max_clients_per_uid: int | None = None
    idle_timeout_s: float = 300.0
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    view_pin_bytes: int | None = None
    view_pin_total_bytes: int | None = None

    def __post_init__(self) -> None:
        check_daemon(self)

    @property
    def socket_mode_bits(self) -> int:
        """``socket_mode`` as an int (``"0600" -> 0o600``)."""
        return int(self.socket_mode.replace("o", ""), 8)

    @property
    def uid_connection_cap(self) -> int:
        """``max_clients_per_uid``, or ``max_clients`` when it is ``None``."""
        return self.max_clients if self.max_clients_per_uid is None else self.max_clients_per_uid

    def resolved_socket_path(self) -> str:
        """``socket_path``, or the default for this user when it is ``None``."""
        if self.socket_path is not None:
            return self.socket_path
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        if runtime and os.path.isdir(runtime):
            return os.path.join(runtime, "ectier.sock")
        return f"/tmp/ectier-{os.getuid()}.sock"
