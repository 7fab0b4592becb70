"""A bare daemon protocol connection for the daemon tests (:class:`RawConn`): any bytes sent,
replies read as they come, no retries (what a misbehaving client does)."""

from __future__ import annotations

import socket
from typing import Any

import msgpack

from ectier.daemon.protocol import PROTOCOL_VERSION, FrameDecoder, ProtocolError, encode_frame

class RawConn:
    """A bare protocol connection: send any bytes, read replies (no retries).

    ``hello=True`` (default): say ``hello`` first, as the daemon requires before any other
    request; its reply is ``hello_reply`` (an error reply, e.g. a refused connection's, stays
    queued for :meth:`reply` instead). ``hello=False``: nothing is sent.
    """

    def __init__(self, path: str, *, timeout: float = 5.0, hello: bool = True, name: str = "raw") -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except BaseException:
            self.sock.close()
            raise
        self.decoder = FrameDecoder(1 << 30)
        self.pending: list[dict[str, Any]] = []
        self.eof = False
        self.hello_reply: dict[str, Any] | None = None
        if hello:
            try:
                self.send(encode_frame({"id": 0, "op": "hello", "version": PROTOCOL_VERSION, "client": name}))
            except OSError:
                pass  # refused and closed already: its error reply is still readable
            r = self.reply()
            if r is not None and r.get("ok"):
                self.hello_reply = r
            elif r is not None:
                self.pending.insert(0, r)

    def __enter__(self) -> "RawConn":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_msg(self, msg: Any) -> None:
        body = msgpack.packb(msg, use_bin_type=True)
        self.send(len(body).to_bytes(4, "big") + body)

    def reply(self) -> dict[str, Any] | None:
        """The next reply, or ``None`` when the daemon closed the connection."""
        while not self.pending:
            if self.eof:
                return None
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                self.eof = True
                return None
            for m in self.decoder.feed(data):
                assert not isinstance(m, ProtocolError), f"daemon sent an undecodable reply: {m}"
                self.pending.append(m)
        return self.pending.pop(0)

    def request(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.send(encode_frame(msg))
        r = self.reply()
        if r is None:
            raise ConnectionResetError("daemon closed the connection")
        return r

    def replies_until_eof(self) -> list[dict[str, Any]]:
        """Every reply until the daemon closes the connection (socket timeout -> raises)."""
        out = []
        while True:
            r = self.reply()
            if r is None:
                return out
            out.append(r)

    def send_all_then_read_replies(self, data: bytes) -> list[dict[str, Any]]:
        """Send ``data``, say no more (shut the writing side), and return every reply until the
        daemon closes the connection. A daemon that hangs up first (a fatal framing error) cuts the
        sending short: what it answered before is still returned."""
        try:
            self.send(data)
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the daemon hung up first (fatal framing error)
        return self.replies_until_eof()
