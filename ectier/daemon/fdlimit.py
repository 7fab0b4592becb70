"""The daemon's file descriptors: what ``daemon.max_clients`` needs of ``RLIMIT_NOFILE``.

Every client connection holds one descriptor in the daemon; the daemon also keeps a few of its
own (the listening socket, the arena and its lock, LMDB's files, scratch files of direct reads
and writes, the metrics listener, pidfds of view holders, logs): :data:`FD_MARGIN`. At start-up
:func:`raise_nofile_limit` raises the soft limit towards the hard one when
``daemon.max_clients + FD_MARGIN`` needs it, and logs one WARNING when the hard limit is too low
for that. A daemon out of descriptors anyway (other processes' use of ``ENFILE``, a low hard
limit) keeps serving: the accept loop backs off and makes room
(:meth:`ectier.daemon.serving.ConnectionServing._accept_failed`).
"""

from __future__ import annotations

import errno
import logging

__all__ = ["FD_MARGIN", "ACCEPT_RESOURCE_ERRNOS", "raise_nofile_limit"]

log = logging.getLogger("ectier.daemon")

#: descriptors the daemon needs besides its connections (see the module docstring)
FD_MARGIN = 64

#: errors of ``accept()`` that mean "out of descriptors or memory for now", not a broken listener
ACCEPT_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


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
            "out of descriptors, the daemon closes idle connections to accept new ones, and new ones wait "
            "while none is idle. Raise the limit (systemd: LimitNOFILE=%d in "
            "the unit's [Service] section; a shell: ulimit -n %d before ectier serve) or lower "
            "daemon.max_clients", max_clients, need, FD_MARGIN, soft, _show(hard), refused, need, need)
    return soft, hard


def _enough(limit: int, need: int) -> bool:
    import resource

    return limit == resource.RLIM_INFINITY or limit >= need


def _show(limit: int) -> str:
    import resource

    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)
