"""The ectier daemon protocol, sans I/O: framing, message schemas, typed errors.

Transport: a Unix domain stream socket. Every message is one **frame**::

    +----------------------+--------------------------------------+
    | length: u32 big-end. | body: one msgpack map (length bytes) |
    +----------------------+--------------------------------------+

A request is a map ``{"id": <int>, "op": <str>, ...arguments}``; the reply to it carries the same
``id`` and either ``"ok": true`` with the results, or ``"ok": false`` and
``"error": {"type": <error class name>, "message": <str>}``. Tensor bytes never travel in frames:
they move through the shared host arena (a file in ``/dev/shm`` every client maps), at the byte
extents a reply names. See ``docs/protocol.md`` for every operation.

Nothing here does I/O: :class:`FrameDecoder` turns received bytes into messages,
:func:`encode_frame` turns a message into bytes, :func:`parse_request` checks a request against
its schema. The server and the client share this module.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from ..entry import DTYPE_ITEMSIZE
from ..errors import EctierError

__all__ = [
    "PROTOCOL_VERSION",
    "FEATURES",
    "MAX_BATCH_KEYS",
    "MAX_DIMS",
    "DEFAULT_MAX_FRAME_BYTES",
    "ProtocolError",
    "FrameDecoder",
    "encode_frame",
    "parse_request",
    "Request",
    "OPS",
    "error_reply",
    "ok_reply",
]

#: Bumped on any incompatible change; the handshake refuses a mismatch.
PROTOCOL_VERSION = 1
#: Default cap of one frame's body, in bytes (control messages only; tensor bytes go through shm).
DEFAULT_MAX_FRAME_BYTES = 1 << 20

_LEN = struct.Struct(">I")


class ProtocolError(EctierError):
    """A frame or message that breaks the protocol (oversized, undecodable, wrong schema); an
    :class:`~ectier.errors.EctierError`, so a caller that turns ectier's errors into misses turns
    these too.

    ``fatal`` is True when the byte stream can no longer be trusted (framing lost): the server
    replies once and closes that connection; other connections are unaffected.
    """

    def __init__(self, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


def encode_frame(message: dict[str, Any], *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """Serialise one message into a frame (length prefix + msgpack body).

    Raises:
        ProtocolError: the body would exceed ``max_frame_bytes`` (the message names
            ``daemon.max_frame_bytes``, the receiving daemon's cap).
    """
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > max_frame_bytes:
        raise ProtocolError(f"{message.get('op', 'request')}: a frame of {len(body)} bytes exceeds the "
                            f"{max_frame_bytes}-byte cap of one request (daemon.max_frame_bytes); send fewer "
                            "or shorter keys per call, or raise daemon.max_frame_bytes")
    return _LEN.pack(len(body)) + body


class FrameDecoder:
    """Incremental decoder: ``feed(data)`` returns the complete messages received so far.

    A frame whose declared length exceeds ``max_frame_bytes`` is a fatal :class:`ProtocolError`,
    found before its body is buffered (no memory blow-up): the messages decoded before it in the
    same ``feed`` are returned and the error is kept in :attr:`fatal` (raised by that ``feed``
    when there are none, and by every later one). A body that is not a msgpack map gives a
    non-fatal one (the stream stays aligned on frame boundaries); the decoder then continues with
    the next frame.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        #: the fatal framing error met, if any: nothing after it can be decoded
        self.fatal: ProtocolError | None = None

    def feed(self, data: bytes) -> list[dict[str, Any] | ProtocolError]:
        """Add received bytes; return decoded messages, with a ProtocolError in place of a bad body.

        Raises:
            ProtocolError: (fatal) a declared frame length above the cap with no message before it
                in ``data``, or any call after one (:attr:`fatal`).
        """
        if self.fatal is not None:
            raise self.fatal
        self._buf += data
        out: list[dict[str, Any] | ProtocolError] = []
        while len(self._buf) >= _LEN.size:
            (length,) = _LEN.unpack_from(self._buf)
            if length > self.max_frame_bytes:
                self._buf.clear()
                self.fatal = ProtocolError(
                    f"frame of {length} bytes exceeds the {self.max_frame_bytes}-byte cap", fatal=True
                )
                if out:
                    return out
                raise self.fatal
            if len(self._buf) < _LEN.size + length:
                break
            body = bytes(self._buf[_LEN.size : _LEN.size + length])
            del self._buf[: _LEN.size + length]
            out.append(_decode_body(body))
        return out

    @property
    def pending_bytes(self) -> int:
        """Bytes received but not yet forming a whole frame."""
        return len(self._buf)


def _decode_body(body: bytes) -> dict[str, Any] | ProtocolError:
    try:
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True, max_bin_len=0,
                              max_array_len=1 << 16, max_map_len=1 << 10)
    except Exception as exc:  # msgpack raises many types (ExtraData, ValueError, ...)
        return ProtocolError(f"undecodable msgpack body: {type(exc).__name__}: {exc}")
    if not isinstance(msg, dict):
        return ProtocolError(f"message must be a map, got {type(msg).__name__}")
    return msg


# ----------------------------------------------------------------------------- schemas

_STR = (str,)
_INT = (int,)
_BOOL = (bool,)
_LIST = (list,)
#: most keys one ``prefetch`` names (its reply is one frame; keys are at most 64 KiB each, so
#: clients batch a scheduler step's items, not a whole cache)
MAX_BATCH_KEYS = 1024
#: most dimensions of an entry's shape that ``reserve`` takes
MAX_DIMS = 32
#: what this daemon offers beyond protocol 1's first operations (the ``hello`` reply's
#: ``features``; a client uses an operation or argument only if its daemon lists it):
#: ``prefetch`` (the batched ``prefetch`` op), ``direct`` (``direct: true`` on ``reserve``/``get``/
#: ``prefetch``: entries the arena cannot hold move through a scratch file), ``view`` (``hold:
#: true`` on ``get`` and ``pin`` on ``prefetch``: process-held leases for zero-copy views, released
#: in batches with ``release``'s ``leases``; see :mod:`ectier.daemon.holders`), ``orphans``
#: (``instance`` on ``abort``: a put whose lease expired, or whose connection closed, keeps its
#: blocks reserved until its process aborts it from any connection or exits; see
#: :mod:`ectier.daemon.leases`), ``bye`` (the client writes into none of its connection's
#: reservations any more: they end at the close instead of becoming orphans)
FEATURES = ("prefetch", "direct", "view", "orphans", "bye")

#: op -> {argument: (types, required)}
OPS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "hello": {"version": (_INT, True), "client": (_STR, False)},
    "ping": {},
    "reserve": {"key": (_STR, True), "namespace": (_STR, False), "dtype": (_STR, True), "shape": (_LIST, True),
                "direct": (_BOOL, False)},
    "commit": {"lease": (_INT, True)},
    "abort": {"lease": (_INT, True), "instance": (_STR, False)},
    "bye": {},
    "get": {"key": (_STR, True), "namespace": (_STR, False), "direct": (_BOOL, False), "hold": (_BOOL, False)},
    "prefetch": {"keys": (_LIST, True), "namespace": (_STR, False), "direct": (_BOOL, False), "pin": (_LIST, False)},
    "release": {"lease": (_INT, False), "leases": (_LIST, False), "instance": (_STR, False)},
    "contains": {"key": (_STR, True), "namespace": (_STR, False)},
    "delete": {"key": (_STR, True), "namespace": (_STR, False)},
    "stats": {},
}


@dataclass(frozen=True)
class Request:
    """A request that passed its schema: ``op``, ``id`` and the arguments as a dict."""

    id: int
    op: str
    args: dict[str, Any]


def parse_request(msg: dict[str, Any]) -> Request:
    """Check a decoded message against its op's schema.

    Raises:
        ProtocolError: (non-fatal) missing/unknown op, missing or mistyped argument, unknown
            argument, bad dtype or shape. The message names the offending field.
    """
    rid = msg.get("id")
    if isinstance(rid, bool) or not isinstance(rid, int):
        raise ProtocolError("request field 'id': expected an int")
    op = msg.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise ProtocolError(f"request field 'op': unknown operation {op!r}; known: {', '.join(OPS)}")
    schema = OPS[op]
    args: dict[str, Any] = {}
    for name, value in msg.items():
        if name in ("id", "op"):
            continue
        if name not in schema:
            raise ProtocolError(f"{op}: unknown argument {name!r}")
        types, _ = schema[name]
        if (isinstance(value, bool) and types is not _BOOL) or not isinstance(value, types):
            raise ProtocolError(f"{op}: argument {name!r} must be {'/'.join(t.__name__ for t in types)}")
        args[name] = value
    for name, (_, required) in schema.items():
        if required and name not in args:
            raise ProtocolError(f"{op}: missing argument {name!r}")
    if op == "reserve":
        if args["dtype"] not in DTYPE_ITEMSIZE:
            raise ProtocolError(f"reserve: argument 'dtype' {args['dtype']!r} is not supported")
        shape = args["shape"]
        if len(shape) > MAX_DIMS or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 or d >= 1 << 48
                                        for d in shape):
            raise ProtocolError(f"reserve: argument 'shape' must be a list of at most {MAX_DIMS} ints in [0, 2**48)")
        args["shape"] = tuple(shape)
    if op == "prefetch":
        for name in ("keys", "pin"):
            keys = args.get(name, ())
            if len(keys) > MAX_BATCH_KEYS or not all(isinstance(k, str) for k in keys):
                raise ProtocolError(f"prefetch: argument {name!r} must be a list of at most {MAX_BATCH_KEYS} strs")
    if op == "release" and "leases" in args:
        ids = args["leases"]
        if len(ids) > MAX_BATCH_KEYS or not all(not isinstance(i, bool) and isinstance(i, int) and 0 <= i < 1 << 63
                                                for i in ids):
            raise ProtocolError(f"release: argument 'leases' must be a list of at most {MAX_BATCH_KEYS} lease ids")
    for name in ("lease",):
        if name in args and not 0 <= args[name] < 1 << 63:
            raise ProtocolError(f"{op}: argument {name!r} out of range")
    return Request(rid, op, args)


def ok_reply(rid: int, **results: Any) -> dict[str, Any]:
    """A success reply to request ``rid``."""
    return {"id": rid, "ok": True, **results}


def error_reply(rid: int | None, error_type: str, message: str) -> dict[str, Any]:
    """A typed error reply (``rid`` is ``None`` when the request had no readable id)."""
    return {"id": rid, "ok": False, "error": {"type": error_type, "message": message}}
