"""The self-describing record header of the NVMe tier, and the payload checksum.

Pure Python + numpy + xxhash; no torch or lmdb import (the "pure" layer of docs/architecture.md,
"Layers"). Every size in this module is in **bytes** unless its name says otherwise. The codecs that
turn tensor bytes into the stored payload live in :mod:`ectier.codec`, which re-exports every name
of this module too.

Each NVMe record is self-describing: :func:`pack_header` turns a :class:`RecordHeader` into the bytes
below; :func:`unpack_header` checks and parses them, raising :class:`~ectier.errors.CorruptRecordError`
(never returning a header) when anything is off. All integers are little-endian and unsigned.

======  ========  =======  ==================================================================
offset  size      type     field
======  ========  =======  ==================================================================
0       4         bytes    magic ``b"ECTR"`` (:data:`RECORD_MAGIC`)
4       2         u16      format version, ``1`` (:data:`RECORD_FORMAT_VERSION`)
6       2         u16      ``codec_id``
8       4         u32      ``H``: header length in bytes, this table in full, checksum included
12      8         u64      ``raw_nbytes``: length of the tensor bytes
20      8         u64      ``payload_nbytes``: length of the stored (encoded) payload
28      8         u64      ``payload_checksum``: xxh3_64 of the stored payload bytes
36      8         u64      ``version``: monotonic write version
44      8         u64      ``created_ns``: wall clock at write, ns since the Unix epoch
52      2         u16      ``ndim``
54      2         u16      ``Ld``: length of ``dtype``
56      4         u32      ``Ln``: length of ``namespace``
60      4         u32      ``Lk``: length of ``key``
64      4         u32      ``Lc``: length of ``codec_config``
68      Ld        utf-8    ``dtype``, e.g. ``bfloat16``
...     8*ndim    u64[]    ``shape``
...     Ln        utf-8    ``namespace``
...     Lk        utf-8    ``key`` (any ``str``: NUL, non-ASCII; 64 KiB and more)
...     Lc        utf-8    ``codec_config`` as compact JSON, keys sorted, e.g. ``{"level":1}``
H-8     8         u64      xxh3_64 of bytes ``[0, H-8)``
======  ========  =======  ==================================================================

``H = 76 + Ld + 8*ndim + Ln + Lk + Lc``, at most :data:`MAX_HEADER_NBYTES`. The header length is a
u32, not a u16: a key may itself be 64 KiB of UTF-8. The payload is not part of the header: store
it as a separate value, or right after the header in one value (:func:`pack_record` /
:func:`split_record`); check it with :func:`verify_payload` before decoding. A reader meeting an
unknown format version refuses the record (a miss), it never guesses.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Union

import numpy as np
import xxhash

from ectier.errors import CorruptRecordError

if TYPE_CHECKING:
    from ectier.codec import Codec

__all__ = [
    "checksum",
    "RecordHeader",
    "pack_header",
    "unpack_header",
    "header_nbytes",
    "peek_header",
    "verify_payload",
    "pack_record",
    "split_record",
    "RECORD_MAGIC",
    "RECORD_FORMAT_VERSION",
    "MAX_HEADER_NBYTES",
]

BytesLike = Union[bytes, bytearray, memoryview, np.ndarray]

RECORD_MAGIC = b"ECTR"
RECORD_FORMAT_VERSION = 1
#: Upper bound on a packed header, in bytes (a 64 KiB key and namespace fit many times over).
MAX_HEADER_NBYTES = 1 << 20

# Id of the ``raw`` codec (``RawCodec.codec_id`` is defined from it): its payload is the tensor
# bytes, so a header with this id must have ``payload_nbytes == raw_nbytes``.
_RAW_CODEC_ID = 0

_U64_MAX = (1 << 64) - 1
_FIXED = struct.Struct("<4sHHIQQQQQHHIII")  # offsets 0..67, see the module docstring
_PREFIX = struct.Struct("<4sHHI")  # magic, format version, codec id, header length
_TRAILER = struct.Struct("<Q")
_MIN_HEADER_NBYTES = _FIXED.size + _TRAILER.size
assert _FIXED.size == 68


def _byte_view(data: Any, what: str = "data") -> memoryview:
    """A 1-D unsigned-byte memoryview over ``data`` without copying (the codecs use it too).

    Raises ``TypeError`` if ``data`` does not support the buffer protocol and ``ValueError`` if it
    is not C-contiguous.
    """
    mv = data if isinstance(data, memoryview) else memoryview(data)
    if mv.ndim == 1 and mv.format == "B":
        return mv
    if not mv.c_contiguous:
        raise ValueError(f"{what} must be a C-contiguous buffer")
    try:
        return mv.cast("B")
    except TypeError:  # a format memoryview cannot cast (numpy structured dtypes, ...)
        return memoryview(np.frombuffer(mv, dtype=np.uint8))


def _short(s: str) -> str:
    """A key or namespace trimmed for an error message (keys may be 64 KiB)."""
    return repr(s) if len(s) <= 80 else f"{s[:60]!r}...({len(s)} chars)"


def checksum(buf: BytesLike) -> int:
    """xxh3_64 of the bytes of ``buf`` (any C-contiguous buffer), as an unsigned int."""
    return xxhash.xxh3_64_intdigest(_byte_view(buf, "buf"))


def _check_uint(name: str, value: Any, bits: int = 64) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"RecordHeader.{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if not 0 <= value < (1 << bits):
        raise ValueError(f"RecordHeader.{name} must be in [0, 2**{bits}), got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class RecordHeader:
    """Everything needed to find, check and decode one stored payload.

    ``raw_nbytes``: length of the tensor bytes; ``payload_nbytes``: length of the stored payload;
    ``payload_checksum``: :func:`checksum` of the stored payload; ``version``: monotonic write
    version (u64); ``created_ns``: wall clock at write (``time.time_ns()``); ``codec_config``: the
    codec's parameters (``codec.get_params()``), small and JSON-serialisable.

    The constructor checks types, ranges and the consistency that can be checked without knowing
    the dtype's itemsize (``raw`` payload length equals ``raw_nbytes``; ``raw_nbytes`` is 0 for an
    empty shape and a multiple of at least one byte per element otherwise), raising ``TypeError``
    or ``ValueError``. ``shape`` is normalised to a tuple of ints, ``codec_config`` copied.
    """

    codec_id: int
    dtype: str
    shape: tuple[int, ...]
    namespace: str
    key: str
    raw_nbytes: int
    payload_nbytes: int
    payload_checksum: int
    version: int
    created_ns: int
    codec_config: dict[str, Any] = dataclasses.field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "codec_id", _check_uint("codec_id", self.codec_id, 16))
        for name in ("dtype", "namespace", "key"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"RecordHeader.{name} must be a str, got {type(getattr(self, name)).__name__}")
        if not self.dtype:
            raise ValueError("RecordHeader.dtype must not be empty")
        try:
            shape = tuple(self.shape)
        except TypeError:
            raise TypeError(f"RecordHeader.shape must be a sequence of ints, got {self.shape!r}") from None
        if len(shape) > 0xFFFF:
            raise ValueError(f"RecordHeader.shape has {len(shape)} dimensions, at most 65535")
        set_(self, "shape", tuple(_check_uint("shape", d) for d in shape))
        for name in ("raw_nbytes", "payload_nbytes", "payload_checksum", "version", "created_ns"):
            set_(self, name, _check_uint(name, getattr(self, name)))
        if not isinstance(self.codec_config, Mapping) or not all(
            isinstance(k, str) for k in self.codec_config
        ):
            raise TypeError(f"RecordHeader.codec_config must be a dict with str keys, got {self.codec_config!r}")
        set_(self, "codec_config", dict(self.codec_config))
        # Consistency checkable without the dtype's itemsize.
        numel = math.prod(self.shape)
        if numel == 0 and self.raw_nbytes != 0:
            raise ValueError(f"shape {self.shape} has no elements but raw_nbytes is {self.raw_nbytes}")
        if numel and (self.raw_nbytes < numel or self.raw_nbytes % numel):
            raise ValueError(
                f"raw_nbytes {self.raw_nbytes} is not a whole number (>= 1) of bytes per element "
                f"for shape {self.shape} ({numel} elements)"
            )
        if self.codec_id == _RAW_CODEC_ID and self.payload_nbytes != self.raw_nbytes:
            raise ValueError(
                f"codec 'raw' stores raw_nbytes={self.raw_nbytes} bytes, "
                f"but payload_nbytes is {self.payload_nbytes}"
            )

    @property
    def itemsize(self) -> int | None:
        """Bytes per element (``raw_nbytes / numel``), or ``None`` for an empty shape."""
        numel = math.prod(self.shape)
        return self.raw_nbytes // numel if numel else None

    def codec(self) -> Codec:
        """The registered codec that wrote this record (``UnknownCodecError`` if none is)."""
        from ectier.codec import get_codec  # lazy: ectier.codec imports this module

        params = {k: v for k, v in self.codec_config.items() if k != "name"}
        return get_codec(self.codec_id, **params)


def pack_header(h: RecordHeader) -> bytes:
    """Serialise ``h`` to the layout in the module docstring.

    Raises ``ValueError`` if a string cannot be encoded as UTF-8 (lone surrogates), if
    ``codec_config`` is not JSON-serialisable, or if the header exceeds :data:`MAX_HEADER_NBYTES`.
    """
    if not isinstance(h, RecordHeader):
        raise TypeError(f"pack_header expects a RecordHeader, got {type(h).__name__}")
    dtype = h.dtype.encode("utf-8")
    namespace = h.namespace.encode("utf-8")
    key = h.key.encode("utf-8")
    try:
        config = json.dumps(
            h.codec_config, separators=(",", ":"), sort_keys=True, allow_nan=False, ensure_ascii=False
        ).encode("utf-8")
    except TypeError as exc:
        raise ValueError(f"RecordHeader.codec_config is not JSON-serialisable: {exc}") from exc
    if len(dtype) > 0xFFFF:
        raise ValueError(f"RecordHeader.dtype is {len(dtype)} bytes of UTF-8, at most 65535")
    total = _MIN_HEADER_NBYTES + len(dtype) + 8 * len(h.shape) + len(namespace) + len(key) + len(config)
    if total > MAX_HEADER_NBYTES:
        raise ValueError(
            f"record header would be {total} bytes, more than MAX_HEADER_NBYTES={MAX_HEADER_NBYTES} "
            f"(key {len(key)} bytes, namespace {len(namespace)} bytes)"
        )
    body = b"".join(
        (
            _FIXED.pack(
                RECORD_MAGIC,
                RECORD_FORMAT_VERSION,
                h.codec_id,
                total,
                h.raw_nbytes,
                h.payload_nbytes,
                h.payload_checksum,
                h.version,
                h.created_ns,
                len(h.shape),
                len(dtype),
                len(namespace),
                len(key),
                len(config),
            ),
            dtype,
            struct.pack(f"<{len(h.shape)}Q", *h.shape),
            namespace,
            key,
            config,
        )
    )
    return body + _TRAILER.pack(xxhash.xxh3_64_intdigest(body))


def header_nbytes(buf: BytesLike) -> int:
    """The header length ``H`` declared by the record starting at ``buf``, after checking its prefix.

    ``buf`` may hold more than the header (a whole record). Raises
    :class:`~ectier.errors.CorruptRecordError` when ``buf`` is too short, the magic or format
    version is wrong, or ``H`` is out of range or longer than ``buf``.
    """
    mv = _byte_view(buf, "buf")
    if len(mv) < _MIN_HEADER_NBYTES:
        raise CorruptRecordError(
            f"record too short: {len(mv)} bytes, a header is at least {_MIN_HEADER_NBYTES}"
        )
    magic, fmt, _codec_id, total = _PREFIX.unpack_from(mv)
    if magic != RECORD_MAGIC:
        raise CorruptRecordError(f"bad record magic {magic!r}, expected {RECORD_MAGIC!r}")
    if fmt != RECORD_FORMAT_VERSION:
        raise CorruptRecordError(
            f"unsupported record format version {fmt} (this build reads {RECORD_FORMAT_VERSION})"
        )
    if not _MIN_HEADER_NBYTES <= total <= MAX_HEADER_NBYTES:
        raise CorruptRecordError(
            f"record header length {total} is outside [{_MIN_HEADER_NBYTES}, {MAX_HEADER_NBYTES}]"
        )
    if total > len(mv):
        raise CorruptRecordError(f"record header declares {total} bytes, only {len(mv)} present")
    return total


def peek_header(buf: BytesLike) -> tuple[int, int, int]:
    """The cheap checks of a packed header at the start of ``buf`` (which may hold more): prefix,
    length and the header's own xxh3-64 checksum; returns ``(header length H, version,
    payload_nbytes)`` without parsing the rest (opening a store of 100,000 records with this takes
    a fraction of :func:`unpack_header`'s time; a header that passes was packed by
    :func:`pack_header`, which checked every field). Raises
    :class:`~ectier.errors.CorruptRecordError` when a check fails."""
    mv = _byte_view(buf, "buf")
    total = header_nbytes(mv)
    (stored,) = _TRAILER.unpack_from(mv, total - 8)
    if stored != xxhash.xxh3_64_intdigest(mv[: total - 8]):
        raise CorruptRecordError("record header checksum mismatch")
    fields = _FIXED.unpack_from(mv)
    return total, fields[7], fields[5]


def unpack_header(buf: BytesLike) -> RecordHeader:
    """Check and parse a header packed by :func:`pack_header`; ``buf`` must be exactly the header.

    Raises :class:`~ectier.errors.CorruptRecordError`, with a specific message, for: too short,
    bad magic, unsupported format version, declared length different from ``len(buf)``, header
    checksum mismatch, field lengths that do not add up, undecodable UTF-8 or JSON, and fields
    that are out of range or inconsistent. Never returns a header from bytes that fail a check.
    """
    mv = _byte_view(buf, "buf")
    total = header_nbytes(mv)
    if total != len(mv):
        raise CorruptRecordError(f"record header length mismatch: declares {total} bytes, got {len(mv)}")
    (stored,) = _TRAILER.unpack_from(mv, total - 8)
    actual = xxhash.xxh3_64_intdigest(mv[: total - 8])
    if stored != actual:
        raise CorruptRecordError(f"record header checksum mismatch: stored {stored:#018x}, computed {actual:#018x}")
    (
        _magic,
        _fmt,
        codec_id,
        _total,
        raw_nbytes,
        payload_nbytes,
        payload_checksum,
        version,
        created_ns,
        ndim,
        ld,
        ln,
        lk,
        lc,
    ) = _FIXED.unpack_from(mv)
    if _MIN_HEADER_NBYTES + ld + 8 * ndim + ln + lk + lc != total:
        raise CorruptRecordError(
            f"record header field lengths (dtype {ld}, ndim {ndim}, namespace {ln}, key {lk}, "
            f"codec_config {lc}) do not add up to the header length {total}"
        )
    pos = _FIXED.size

    def take(n: int) -> memoryview:
        nonlocal pos
        part = mv[pos : pos + n]
        pos += n
        return part

    try:
        dtype = str(take(ld), "utf-8")
        shape = struct.unpack(f"<{ndim}Q", take(8 * ndim))
        namespace = str(take(ln), "utf-8")
        key = str(take(lk), "utf-8")
        config_text = str(take(lc), "utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptRecordError(f"record header holds invalid UTF-8: {exc}") from exc
    try:
        codec_config = json.loads(config_text)
    except ValueError as exc:
        raise CorruptRecordError(f"record header codec_config is not valid JSON: {exc}") from exc
    if not isinstance(codec_config, dict):
        raise CorruptRecordError(f"record header codec_config is not a JSON object: {config_text[:80]!r}")
    try:
        return RecordHeader(
            codec_id=codec_id,
            dtype=dtype,
            shape=shape,
            namespace=namespace,
            key=key,
            raw_nbytes=raw_nbytes,
            payload_nbytes=payload_nbytes,
            payload_checksum=payload_checksum,
            version=version,
            created_ns=created_ns,
            codec_config=codec_config,
        )
    except (TypeError, ValueError) as exc:
        raise CorruptRecordError(f"record header is inconsistent: {exc}") from exc


def verify_payload(header: RecordHeader, payload: BytesLike) -> None:
    """Check ``payload`` against ``header``: length ``payload_nbytes`` and xxh3_64 ``payload_checksum``.

    Raises :class:`~ectier.errors.CorruptRecordError` naming the record on any difference.
    """
    mv = _byte_view(payload, "payload")
    where = f"record {_short(header.namespace)}/{_short(header.key)} (version {header.version})"
    if len(mv) != header.payload_nbytes:
        raise CorruptRecordError(f"{where}: payload is {len(mv)} bytes, header says {header.payload_nbytes}")
    actual = xxhash.xxh3_64_intdigest(mv)
    if actual != header.payload_checksum:
        raise CorruptRecordError(
            f"{where}: payload checksum mismatch: header {header.payload_checksum:#018x}, "
            f"computed {actual:#018x}"
        )


def pack_record(header: RecordHeader, payload: BytesLike) -> bytearray:
    """``pack_header(header) + payload`` in one allocation (one copy of the payload).

    Raises ``ValueError`` if ``len(payload) != header.payload_nbytes``; the checksum is not
    recomputed (the writer computed it with :func:`checksum` when building ``header``).
    """
    head = pack_header(header)
    src = _byte_view(payload, "payload")
    if len(src) != header.payload_nbytes:
        raise ValueError(f"payload is {len(src)} bytes, header.payload_nbytes is {header.payload_nbytes}")
    record = bytearray(len(head) + len(src))
    record[: len(head)] = head
    record[len(head) :] = src
    return record


def split_record(buf: BytesLike, *, verify: bool = True) -> tuple[RecordHeader, memoryview]:
    """Parse a record written by :func:`pack_record`: ``(header, payload view into buf)``.

    With ``verify`` (default) the payload is checked by :func:`verify_payload`; without it only its
    length is. Raises :class:`~ectier.errors.CorruptRecordError`. The view is only valid as long
    as ``buf`` is (an LMDB buffer: until the transaction ends).
    """
    mv = _byte_view(buf, "buf")
    total = header_nbytes(mv)
    header = unpack_header(mv[:total])
    payload = mv[total:]
    if verify:
        verify_payload(header, payload)
    elif len(payload) != header.payload_nbytes:
        raise CorruptRecordError(
            f"record payload is {len(payload)} bytes, header says {header.payload_nbytes}"
        )
    return header, payload
