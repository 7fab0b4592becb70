"""Redis commands bounded by their call's deadline as a whole, not per socket operation.

redis-py's ``socket_timeout`` bounds each ``recv``/``send`` on its own: a reply that trickles in
(a congested link, a server swapping) never waits ``socket_timeout`` at once, so one command could
take any time (measured: a 1 MiB reply at ~80 KB/s held a ``get`` with ``timeout_s: 1`` for
13 s). The connections made here hand redis-py a socket whose every ``recv``, ``recv_into`` and
``sendall`` is also bounded by what is left of the deadline that :func:`command_deadline` set on
the calling thread; past it, the socket raises ``socket.timeout``, which redis-py turns into its
``TimeoutError`` after dropping the connection (a half-read reply is never read by the next
command). Outside :func:`command_deadline` the socket behaves as redis-py's own.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Iterator

from redis.connection import Connection, SSLConnection

__all__ = ["command_deadline", "DeadlineConnection", "DeadlineSSLConnection"]

_local = threading.local()


@contextlib.contextmanager
def command_deadline(end: float) -> Iterator[None]:
    """Bound the socket operations of the commands this thread runs inside to ``end``
    (a ``time.monotonic()`` instant)."""
    before = getattr(_local, "end", None)
    _local.end = end
    try:
        yield
    finally:
        _local.end = before


class _DeadlineSocket:
    """A socket (plain or TLS) whose blocking reads and sends end by the thread's deadline;
    everything else passes through to it."""

    __slots__ = ("_sock", "_timeout")

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._timeout = sock.gettimeout()

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._timeout

    def _bounded(self) -> bool:
        """Narrow the socket's timeout to what is left of the deadline (True if it did)."""
        end = getattr(_local, "end", None)
        if end is None:
            return False
        left = end - time.monotonic()
        if left <= 0:
            raise socket.timeout("timed out: past the call's deadline")
        if self._timeout is not None and self._timeout <= left:
            return False
        self._sock.settimeout(left)
        return True

    def _call(self, fn: Any, *args: Any) -> Any:
        narrowed = self._bounded()
        try:
            return fn(*args)
        finally:
            if narrowed:
                self._sock.settimeout(self._timeout)

    def recv(self, *args: Any) -> bytes:
        return self._call(self._sock.recv, *args)

    def recv_into(self, *args: Any) -> int:
        return self._call(self._sock.recv_into, *args)

    def sendall(self, *args: Any) -> None:
        return self._call(self._sock.sendall, *args)  # (its timeout bounds the whole sendall)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class DeadlineConnection(Connection):
    """redis-py's TCP connection, on a :class:`_DeadlineSocket`."""

    def _connect(self) -> Any:
        return _DeadlineSocket(super()._connect())


class DeadlineSSLConnection(SSLConnection):
    """redis-py's TLS connection, on a :class:`_DeadlineSocket`."""

    def _connect(self) -> Any:
        return _DeadlineSocket(super()._connect())
