"""Requests a daemon client sends without waiting for their reply (:class:`Submissions`, a base of
:class:`~ectier.daemon.client_conn.Transport`): :meth:`Submissions.submit` sends a request and
returns its id at once; :meth:`Submissions.poll` returns its reply once it has arrived (see
:mod:`ectier.daemon.client_conn` for the rules). Uses the connection state ``Transport`` keeps
(the socket, its lock and decoder, ``timeout_s``, the back-off)."""

from __future__ import annotations

import os
import select
import time
from typing import Any

from .. import errors
from .client_errors import DaemonUnavailableError, reply_results as _results
from .protocol import ProtocolError, encode_frame

__all__ = ["Submissions"]


class Submissions:
    """Submitted requests and their replies (module docstring)."""

    def submit(self, op: str, *, connect: bool = True, **args: Any) -> int:
        """Send one request without waiting for its reply; returns its id for :meth:`poll`.
        Connects first when there is no connection (one probe: no ``connect_retry_s`` wait,
        bounded by ``probe_timeout_s``; during the back-off it fails at once); ``connect=False`` (a
        scheduler step, after :meth:`connect_in_background`): no connect, no read; none raises at once.

        Raises:
            DaemonUnavailableError: unreachable, or the request could not be sent.
            InvalidKeyError: a string of the request is not valid UTF-8.
        """
        with self._lock:
            if connect and self._sock is not None and not self._read_arrived():
                self._drop()  # the daemon closed it (idle timeout, restart): a new one
            if self._sock is None:
                if not connect:
                    raise DaemonUnavailableError(f"not connected to the ectier daemon at {self.socket_path!r}")
                self.connect(wait=False)
            rid = self._next_id
            self._next_id += 1
            try:
                frame = encode_frame({"id": rid, "op": op, **args}, max_frame_bytes=self.max_frame_bytes)
            except UnicodeEncodeError as exc:
                raise errors.InvalidKeyError(f"{op}: strings must be valid UTF-8: {exc}") from None
            try:
                self._send_nowait(frame)
            except OSError as exc:
                self._drop()
                raise DaemonUnavailableError(f"lost the ectier daemon at {self.socket_path!r}: {exc}") from None
            self._submitted[rid] = (op, time.monotonic())
            return rid

    def _send_nowait(self, frame: bytes) -> None:
        """Send ``frame``: one ``write`` of the descriptor, non-blocking since the socket has a
        timeout (a socket's own ``sendall`` polls before every send); what the socket buffer did
        not take is sent with ``sendall`` within ``timeout_s``."""
        try:
            sent = os.write(self._sock.fileno(), frame)
        except BlockingIOError:
            sent = 0
        if sent < len(frame):
            self._sock.settimeout(self.timeout_s)
            self._sock.sendall(frame[sent:])

    def _read_arrived(self) -> bool:
        """Read what the socket holds now (non-blocking reads of the descriptor, no poll) and keep
        the replies of submitted requests; False if the connection is gone (the daemon closed it,
        an error, or lost framing: the submitted requests are then answered by an error)."""
        fd = self._sock.fileno()
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return True
            except OSError as exc:
                self._lose_submitted(str(exc))
                return False
            if not data:
                self._lose_submitted("the daemon closed the connection")
                return False
            for msg in self._decoder.feed(data):
                if isinstance(msg, ProtocolError):
                    self._lose_submitted(f"lost the framing: {msg}")
                    return False
                self._keep_reply(msg)
            if len(data) < 65536:
                return True

    def poll(self, rid: int, timeout: float = 0.0) -> dict[str, Any] | None:
        """The reply to submitted request ``rid`` (as :meth:`call` returns it) once it has arrived,
        else ``None``; waits at most ``timeout`` seconds (0: reads only what has arrived). A reply
        is returned once; polling an id again afterwards raises ``KeyError``.

        Raises:
            the daemon's typed error (an error reply); DaemonUnavailableError: the connection was
            lost before the reply, or the daemon left it unanswered for ``timeout_s`` (hung: the
            connection is dropped and the back-off starts). KeyError: ``rid`` was never
            submitted, or its reply was already taken.
        """
        with self._lock:
            if rid not in self._submitted and rid not in self._arrived:
                raise KeyError(rid)
            deadline = time.monotonic() + timeout
            while rid not in self._arrived:
                if self._sock is None:
                    self._lose_submitted("the connection was closed")
                    break
                if not self._read_arrived():
                    self._drop()
                    break
                wait = deadline - time.monotonic()
                if rid in self._arrived or wait <= 0:
                    break
                try:
                    select.select([self._sock], [], [], wait)
                except (OSError, ValueError) as exc:
                    self._drop()
                    self._lose_submitted(str(exc))
                    break
            if rid not in self._arrived:
                op, sent = self._submitted[rid]
                if time.monotonic() - sent > self.timeout_s:
                    self._drop()
                    self._lose_submitted(f"no answer to {op!r} within {self.timeout_s:g} s")
                    raise self._fail(
                        f"the ectier daemon at {self.socket_path!r} did not answer {op!r} within "
                        f"{self.timeout_s:g} s (hung, stopped or overloaded?)")
                return None
            msg = self._arrived.pop(rid)
            self._submitted.pop(rid, None)
        if isinstance(msg, BaseException):
            raise msg
        return _results(msg)

    def answered(self, rid: int) -> bool:
        """True if :meth:`poll` of ``rid`` would return at once without reading the socket (its
        reply, or its error, is in; or the daemon hung past ``timeout_s``). No I/O."""
        if rid in self._arrived:
            return True
        sent = self._submitted.get(rid)
        return sent is None or time.monotonic() - sent[1] > self.timeout_s

    @property
    def in_flight(self) -> int:
        """Submitted requests whose reply was not taken yet."""
        return len(self._submitted)

    def _keep_reply(self, msg: dict[str, Any]) -> bool:
        """Keep ``msg`` for :meth:`poll` if it answers a submitted request; True if it did."""
        rid = msg.get("id")
        if rid in self._submitted and rid not in self._arrived:
            self._arrived[rid] = msg
            return True
        return False

    def _lose_submitted(self, why: str) -> None:
        """The connection went: every submitted request still unanswered is answered by an error."""
        for rid in self._submitted:
            if rid not in self._arrived:
                self._arrived[rid] = DaemonUnavailableError(
                    f"lost the ectier daemon at {self.socket_path!r} before its reply: {why}")
