"""Redis commands bounded by their call's deadline as a whole, not per socket operation.

redis-py's ``socket_timeout`` bounds each ``recv``/``send`` on its own: a reply that trickles in
(a congested link, a server swapping) never waits ``socket_timeout`` at once, so one command could
take any time (measured: a 1 MiB reply at ~80 KB/s held a ``get`` with ``timeout_s: 1`` for
13 s). The connections made here hand redis-py a socket whose every ``recv``, ``recv_into`` and
``sendall`` is also bounded by what is left of the deadline that :func:`command_deadline` set on
the calling thread; past it, the socket raises ``socket.timeout``, which redis-py turns into its
``TimeoutError`` after dropping the connection (a half-read reply is never read by the next
command). Outside :func:`command_deadline` the socket behaves as redis-py's own.

A cut is told apart from a node that does not answer (:meth:`Command.blames_node`): a node that
sent nothing while the command waited long is failing (the caller marks it unreachable); a node
whose reply was still arriving when the deadline came, or that had little time left to answer,
is not: the call just ran out of time.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Iterator

from redis.connection import Connection, SSLConnection

__all__ = ["command_deadline", "Command", "connection_class", "DeadlineConnection", "DeadlineSSLConnection"]

_local = threading.local()


class Command:
    """What the sockets saw of one :func:`command_deadline`: ``received`` bytes, and ``cut``:
    a read or send ended by the deadline (not by the socket's own timeout)."""

    __slots__ = ("end", "started", "received", "cut")

    def __init__(self, end: float) -> None:
        self.end, self.started, self.received, self.cut = end, time.monotonic(), 0, False

    def blames_node(self, silent_s: float) -> bool:
        """Whether this command's failure is the node's: not cut by the deadline, or cut after the
        node had sent nothing for at least ``silent_s`` seconds."""
        return not self.cut or (self.received == 0 and time.monotonic() - self.started >= silent_s)


@contextlib.contextmanager
def command_deadline(end: float) -> Iterator[Command]:
    """Bound the socket operations of the commands this thread runs inside to ``end``
    (a ``time.monotonic()`` instant); yields the :class:`Command` they report to."""
    before = getattr(_local, "cmd", None)
    _local.cmd = cmd = Command(end)
    try:
        yield cmd
    finally:
        _local.cmd = before


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

    def _bounded(self, cmd: Command | None) -> bool:
        """Narrow the socket's timeout to what is left of the deadline (True if it did)."""
        if cmd is None:
            return False
        left = cmd.end - time.monotonic()
        if left <= 0:
            cmd.cut = True
            raise socket.timeout("timed out: past the call's deadline")
        if self._timeout is not None and self._timeout <= left:
            return False
        self._sock.settimeout(left)
        return True

    def _call(self, fn: Any, *args: Any, read: bool = False) -> Any:
        cmd = getattr(_local, "cmd", None)
        narrowed = self._bounded(cmd)
        try:
            out = fn(*args)
        except socket.timeout:
            if narrowed:
                cmd.cut = True
            raise
        finally:
            if narrowed:
                self._sock.settimeout(self._timeout)
        if read and cmd is not None:
            cmd.received += out if isinstance(out, int) else len(out)
        return out

    def recv(self, *args: Any) -> bytes:
        return self._call(self._sock.recv, *args, read=True)

    def recv_into(self, *args: Any) -> int:
        return self._call(self._sock.recv_into, *args, read=True)

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


def connection_class(tls: bool) -> type:
    """redis-py's connection class to use: :class:`DeadlineSSLConnection` with ``tls``, else
    :class:`DeadlineConnection`."""
    return DeadlineSSLConnection if tls else DeadlineConnection
