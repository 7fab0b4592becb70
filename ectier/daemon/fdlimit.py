"""The daemon's file descriptors: what ``daemon.max_clients`` needs of ``RLIMIT_NOFILE``.

Every client connection holds one descriptor in the daemon; the daemon also keeps a few of its
own (the listening socket, the arena and its lock, LMDB's files, scratch files of direct reads
and writes, the metrics listener, pidfds of view holders, logs): :data:`FD_MARGIN`. At start-up
:func:`raise_nofile_limit` raises the soft limit towards the hard one when
``daemon.max_clients + FD_MARGIN`` needs it, and logs one WARNING when the hard limit is too low
for that. :func:`client_cap` then keeps :data:`FD_MARGIN` descriptors back for the daemon's own
use: it admits at most ``soft limit - FD_MARGIN`` client connections even when
``daemon.max_clients`` is higher (beyond that, the admission rule of
:mod:`ectier.daemon.connections` closes the least recently used idle connection or refuses the
newcomer, as at ``daemon.max_clients``), so connections never take the descriptors of the arena,
LMDB and scratch files. A daemon out of descriptors anyway (other processes' use of ``ENFILE``)
keeps serving: the accept loop backs off and makes room
(:meth:`ectier.daemon.serving.ConnectionServing._accept_failed`), and a scratch file that cannot
be opened fails its request with a ``TierWriteError`` naming the limit
(:func:`descriptor_shortage`).
"""

from __future__ import annotations

import errno
import logging

__all__ = ["FD_MARGIN", "ACCEPT_RESOURCE_ERRNOS", "OUT_OF_DESCRIPTORS", "ClientCap", "client_cap",
           "descriptor_shortage", "raise_nofile_limit"]

log = logging.getLogger("ectier.daemon")

#: descriptors the daemon needs besides its connections (see the module docstring)
FD_MARGIN = 64

#: errors of ``accept()`` that mean "out of descriptors or memory for now", not a broken listener
ACCEPT_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

#: errors of an ``open`` (or a ``dup``) that mean "out of file descriptors" (this process's or the system's)
OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})


def raise_nofile_limit(max_clients: int) -> tuple[int, int] | None:
    """Raise the soft ``RLIMIT_NOFILE`` to ``max_clients + FD_MARGIN`` (at most the hard limit)
    if it is lower; log one WARNING if even the hard limit is lower. Returns the ``(soft, hard)``
    limits now in force, or ``None`` where there are no such limits (not a Unix). Never raises:
    a refused ``setrlimit`` is part of the warning."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not a Unix
        return None
    need = max_clients + FD_MARGIN
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if _enough(soft, need):
        return soft, hard
    target = need if _enough(hard, need) else hard
    refused = ""
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    except (ValueError, OSError) as exc:
        refused = f" (raising the soft limit to {target} failed: {exc})"
    if _enough(soft, need):
        log.info("raised the soft RLIMIT_NOFILE to %d for daemon.max_clients=%d", soft, max_clients)
    else:
        log.warning(
            "daemon.max_clients=%d needs about %d file descriptors (one per connection plus %d for the "
            "arena, LMDB, scratch files and metrics) but RLIMIT_NOFILE allows %d (hard limit %s)%s; "
            "the daemon admits at most %d client connections (the limit less %d kept back) and closes the "
            "least recently used idle one to admit another (a newcomer is refused while none is idle). "
            "Raise the limit (systemd: LimitNOFILE=%d in "
            "the unit's [Service] section; a shell: ulimit -n %d before ectier serve) or lower "
            "daemon.max_clients", max_clients, need, FD_MARGIN, soft, _show(hard), refused,
            max(1, soft - FD_MARGIN), FD_MARGIN, need, need)
    return soft, hard


class ClientCap:
    """How many client connections the daemon admits: ``limit`` (at most ``daemon.max_clients``,
    ``configured``); ``note`` names both knobs for a refusal or a log line."""

    __slots__ = ("limit", "configured", "soft")

    def __init__(self, limit: int, configured: int, soft: int | None) -> None:
        self.limit, self.configured, self.soft = limit, configured, soft

    @property
    def lowered(self) -> bool:
        return self.limit < self.configured

    @property
    def note(self) -> str:
        """``daemon.max_clients=N``, plus, where the descriptor limit lowered it, by how much and why."""
        if not self.lowered:
            return f"daemon.max_clients={self.configured}"
        return (f"daemon.max_clients={self.configured}, lowered to {self.limit} by RLIMIT_NOFILE={self.soft} "
                f"less {FD_MARGIN} descriptors the daemon keeps for itself")


def client_cap(max_clients: int, limits: tuple[int, int] | None) -> ClientCap:
    """The connections the daemon admits: ``min(max_clients, soft - FD_MARGIN)`` (at least 1),
    ``limits`` being what :func:`raise_nofile_limit` returned (``None``: no limit, ``max_clients``).
    Logs once (INFO; :func:`raise_nofile_limit` has warned already) when that is below ``max_clients``."""
    if limits is None or _enough(limits[0], max_clients + FD_MARGIN):
        return ClientCap(max_clients, max_clients, None if limits is None else limits[0])
    soft = limits[0]
    cap = ClientCap(max(1, min(max_clients, soft - FD_MARGIN)), max_clients, soft)
    log.info(
        "admitting at most %d client connections, not daemon.max_clients=%d: the soft RLIMIT_NOFILE is %d and "
        "the daemon keeps %d descriptors back for the arena, LMDB, scratch files and metrics; beyond %d the "
        "least recently used idle connection is closed to make room (a newcomer is refused while none is "
        "idle). Raise LimitNOFILE= / ulimit -n to %d for daemon.max_clients=%d",
        cap.limit, max_clients, soft, FD_MARGIN, cap.limit, max_clients + FD_MARGIN, max_clients)
    return cap


def descriptor_shortage(exc: OSError, what: str) -> str | None:
    """The message for ``exc`` when it is an out-of-descriptors error (EMFILE, ENFILE) met while
    doing ``what`` (e.g. "cannot create a 12000000-byte scratch file in '/dev/shm'"), naming
    ``RLIMIT_NOFILE`` and ``daemon.max_clients``; ``None`` for any other error."""
    if exc.errno not in OUT_OF_DESCRIPTORS:
        return None
    which = ("the system's file table is full (ENFILE)" if exc.errno == errno.ENFILE
             else f"the daemon is at its RLIMIT_NOFILE ({_soft_limit()} descriptors)")
    return (f"{what}: out of file descriptors ({exc.strerror or exc}): {which}; raise the daemon's limit "
            f"(LimitNOFILE= / ulimit -n) or lower daemon.max_clients (the daemon keeps {FD_MARGIN} "
            f"descriptors back from its client connections)")


def _soft_limit() -> str:
    try:
        import resource

        return _show(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    except (ImportError, OSError, ValueError):  # pragma: no cover - not a Unix
        return "?"


def _enough(limit: int, need: int) -> bool:
    import resource

    return limit == resource.RLIM_INFINITY or limit >= need


def _show(limit: int) -> str:
    import resource

    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)
