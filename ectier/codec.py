"""Payload codecs of the NVMe tier: encode tensor bytes into a stored payload and back, by id or name.

Pure Python + numpy + zstandard; no torch or lmdb import (the "pure" layer of docs/architecture.md,
"Layers"). Every size in this module is in **bytes** unless its name says otherwise.

In the spirit of numcodecs: every codec has a numeric ``codec_id`` (stored in each record, so it
must never be reused for a different format) and a ``name``; it round-trips through its config
(``codec_from_config(c.get_config()) == c``); and ``decode_into`` writes into a buffer the caller
owns (a pinned host slot, a numpy array), so a load does not allocate a full-size temporary.

===  ===============  =====================================================================
id   name             stored payload
===  ===============  =====================================================================
0    ``raw``          the tensor bytes as they are (``encode`` returns a view, no copy)
1    ``zstd``         one zstd frame of the tensor bytes
2    ``zstd-planes``  one zstd frame of the tensor bytes split into ``itemsize`` byte planes:
                      first byte 0 of every element, then byte 1 of every element, ...
===  ===============  =====================================================================

Every zstd frame written here carries its content size (checked against the caller's buffer before
anything is decoded, so a corrupt or hostile frame cannot write past ``out`` nor allocate more than
it) and zstd's own content checksum (so ``decode_into`` itself detects a flipped bit, on top of the
record's xxh3 payload checksum).

What compression buys, measured (docs/benchmarks.md, "H200 reference figures"): zstd level
1 on bfloat16 vision-encoder output gives a ratio of about **1.28** on the bytes as they are and about
**1.5** after the byte-plane split (the high byte of a bf16 holds the sign and exponent and
compresses well; the low byte is mantissa noise), at 0.3-0.8 GB/s per thread. Synthetic
``N(0, 1)`` bf16 (float32 normals truncated to their top 16 bits) measures 1.29 plain and 1.46 split
at level 1 on the development machine: the low-byte plane does not compress at all (1.00), the
high-byte plane does (2.7). Level 3 gives a *lower* split ratio (1.41) than level 1 there, and the
split costs encode speed (0.33-0.43 GB/s against 0.65 GB/s plain, one thread). Compression is a
per-tier choice, measured, not assumed: at 0.3-0.8 GB/s per thread it is slower than the disk
(~2 GB/s), so it buys capacity, not speed.

The record header that stores a payload with its codec id, sizes and checksums is in
:mod:`ectier.record`; its names are re-exported here, so ``from ectier.codec import RecordHeader``
keeps working.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import zstandard

from ectier.errors import ConfigError, CorruptRecordError, UnknownCodecError
from ectier.record import (  # the record names are re-exported, see __all__
    _RAW_CODEC_ID, MAX_HEADER_NBYTES, RECORD_FORMAT_VERSION, RECORD_MAGIC, BytesLike, RecordHeader,
    _byte_view, checksum, header_nbytes, pack_header, pack_record, peek_header, split_record, unpack_header,
    verify_payload,
)
from ectier.zstd_frames import PLANE_CHUNK_ROWS, zstd_check_frame, zstd_stream_into

__all__ = [
    "Codec", "RawCodec", "ZstdCodec", "PlaneZstdCodec",
    "get_codec", "register_codec", "codec_from_config", "registered_codecs", "PLANE_CHUNK_ROWS",
    # re-exported from ectier.record
    "checksum", "RecordHeader", "pack_header", "unpack_header", "header_nbytes", "peek_header", "verify_payload",
    "pack_record", "split_record", "RECORD_MAGIC", "RECORD_FORMAT_VERSION", "MAX_HEADER_NBYTES",
]


# --------------------------------------------------------------------------------------------
# buffer helpers
# --------------------------------------------------------------------------------------------


def _writable_byte_view(out: Any) -> memoryview:
    mv = _byte_view(out, "out")
    if mv.readonly:
        raise ValueError("out must be a writable buffer (bytearray, numpy array, writable memoryview)")
    return mv


def _check_itemsize(itemsize: Any) -> int:
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1:
        raise ValueError(f"itemsize must be a positive int (bytes per element), got {itemsize!r}")
    return itemsize


# --------------------------------------------------------------------------------------------
# codecs
# --------------------------------------------------------------------------------------------


class Codec(abc.ABC):
    """A reversible transform of a tensor's raw bytes into a stored payload.

    Subclasses set ``codec_id`` (stored in every record: never reuse one for another format) and
    ``name``, take their parameters as keyword arguments, and list them in ``params``.
    Codecs are immutable values: equal when their configs are equal, picklable, safe to share
    between threads (per-thread zstd contexts are created as needed).
    """

    codec_id: ClassVar[int]
    name: ClassVar[str]
    params: ClassVar[tuple[str, ...]] = ()

    @abc.abstractmethod
    def encode(self, data: BytesLike, itemsize: int) -> bytes | memoryview:
        """Encode the raw tensor bytes ``data`` (C-contiguous buffer; ``itemsize`` bytes per element).

        The result may be a view of ``data`` (``RawCodec``): keep ``data`` alive and unchanged
        until the result has been written. Raises ``ValueError``/``TypeError`` for a bad argument.
        """

    @abc.abstractmethod
    def decode_into(self, payload: BytesLike, out: BytesLike, itemsize: int) -> None:
        """Decode ``payload`` into ``out``, a writable buffer of exactly the raw length in bytes.

        Fills all of ``out``. Raises :class:`~ectier.errors.CorruptRecordError` if the payload is
        invalid or decodes to any length other than ``len(out)`` (``out`` may then hold partial
        output); ``ValueError`` for a read-only ``out`` or a bad ``itemsize``.
        """

    def check(self, payload: BytesLike, raw_nbytes: int, itemsize: int) -> None:
        """Check that ``payload`` decodes to exactly ``raw_nbytes`` bytes, keeping none (``ectier fsck``;
        zstd: through a 1 MiB buffer, whatever a header claims). Raises as :meth:`decode_into`."""
        self.decode_into(payload, np.empty(raw_nbytes, dtype=np.uint8), itemsize)

    def get_config(self) -> dict[str, Any]:
        """``{"name": ..., <param>: <value>, ...}``; JSON-serialisable; see :func:`codec_from_config`."""
        config: dict[str, Any] = {"name": self.name}
        for param in self.params:
            config[param] = getattr(self, param)
        return config

    def get_params(self) -> dict[str, Any]:
        """The parameters alone (``get_config()`` without ``name``), as stored in a record header."""
        return {param: getattr(self, param) for param in self.params}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Codec:
        """Build this codec from ``config`` (``name`` optional, must match if given)."""
        params = dict(config)
        name = params.pop("name", cls.name)
        if name != cls.name:
            raise ConfigError(f"codec config names {name!r}, expected {cls.name!r}")
        return _construct(cls, params)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Codec):
            return NotImplemented
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(self.get_config().items()))))

    def __repr__(self) -> str:
        args = ", ".join(f"{p}={getattr(self, p)!r}" for p in self.params)
        return f"{type(self).__name__}({args})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (codec_from_config, (self.get_config(),))


class RawCodec(Codec):
    """Id 0, ``raw``: the payload is the tensor bytes. ``encode`` is zero-copy; ``decode_into`` copies."""

    codec_id = _RAW_CODEC_ID  # 0
    name = "raw"

    def encode(self, data: BytesLike, itemsize: int) -> memoryview:
        _check_itemsize(itemsize)
        return _byte_view(data)

    def decode_into(self, payload: BytesLike, out: BytesLike, itemsize: int) -> None:
        _check_itemsize(itemsize)
        src = _byte_view(payload, "payload")
        dst = _writable_byte_view(out)
        if len(src) != len(dst):
            raise CorruptRecordError(f"raw payload is {len(src)} bytes, expected {len(dst)}")
        dst[:] = src


class ZstdCodec(Codec):
    """Id 1, ``zstd``: one zstd frame (content size and content checksum included).

    ``level``: zstd level, -7..22 (default 1: ~1.28 on bf16 encoder output, 0.3-0.8 GB/s/thread).
    ``threads``: compression worker threads; 0 (default) compresses on the calling thread, -1 uses
    one per logical CPU. Decompression is always single-threaded. Out-of-range values raise
    :class:`~ectier.errors.ConfigError` (a ``ValueError``) naming the parameter.
    """

    codec_id = 1
    name = "zstd"
    params = ("level", "threads")

    LEVEL_MIN: ClassVar[int] = -7
    LEVEL_MAX: ClassVar[int] = 22
    THREADS_MAX: ClassVar[int] = 256

    def __init__(self, level: int = 1, threads: int = 0) -> None:
        if isinstance(level, bool) or not isinstance(level, int) or not (
            self.LEVEL_MIN <= level <= self.LEVEL_MAX
        ):
            raise ConfigError(
                f"codec {self.name!r}: level must be an int in [{self.LEVEL_MIN}, {self.LEVEL_MAX}], "
                f"got {level!r}"
            )
        if isinstance(threads, bool) or not isinstance(threads, int) or not (
            -1 <= threads <= self.THREADS_MAX
        ):
            raise ConfigError(
                f"codec {self.name!r}: threads must be an int in [-1, {self.THREADS_MAX}] "
                f"(0: calling thread only, -1: one per CPU), got {threads!r}"
            )
        self.level = level
        self.threads = threads
        self._local = threading.local()

    def _compressor(self) -> zstandard.ZstdCompressor:
        # ZstdCompressor is not thread-safe; keep one per thread so its tables are reused.
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            cctx = zstandard.ZstdCompressor(
                level=self.level,
                threads=self.threads,
                write_content_size=True,
                write_checksum=True,
            )
            self._local.cctx = cctx
        return cctx

    def encode(self, data: BytesLike, itemsize: int) -> bytes:
        _check_itemsize(itemsize)
        return self._compressor().compress(_byte_view(data))

    def decode_into(self, payload: BytesLike, out: BytesLike, itemsize: int) -> None:
        _check_itemsize(itemsize)
        src = _byte_view(payload, "payload")
        dst = _writable_byte_view(out)
        zstd_check_frame(src, len(dst))
        zstd_stream_into(src, 1, dst)

    def check(self, payload: BytesLike, raw_nbytes: int, itemsize: int) -> None:
        _check_itemsize(itemsize)
        src = _byte_view(payload, "payload")
        zstd_check_frame(src, raw_nbytes)
        zstd_stream_into(src, 1, None, raw_nbytes)  # (the byte planes' order does not matter here)


class PlaneZstdCodec(ZstdCodec):
    """Id 2, ``zstd-planes``: split into ``itemsize`` byte planes, then one zstd frame.

    For an array of ``n`` elements of ``itemsize`` bytes the compressed stream is byte 0 of every
    element (``n`` bytes), then byte 1 of every element, and so on, in memory order (for
    little-endian bf16: the noisy low mantissa byte, then the sign/exponent byte). With
    ``itemsize == 1`` the payload is identical to ``zstd``'s. Raises ``ValueError`` when the data
    length is not a multiple of ``itemsize``. Parameters as :class:`ZstdCodec`; the split raises the
    ratio on bf16 encoder output from ~1.28 to ~1.5 at level 1.
    """

    codec_id = 2
    name = "zstd-planes"

    def encode(self, data: BytesLike, itemsize: int) -> bytes:
        _check_itemsize(itemsize)
        src = _byte_view(data)
        n = len(src)
        if n % itemsize:
            raise ValueError(f"data is {n} bytes, not a multiple of itemsize {itemsize}")
        if itemsize == 1:
            return self._compressor().compress(src)
        rows = n // itemsize
        src2d = np.frombuffer(src, dtype=np.uint8).reshape(rows, itemsize)
        scratch = np.empty(min(rows, PLANE_CHUNK_ROWS), dtype=np.uint8)
        cobj = self._compressor().compressobj(size=n)
        parts = []
        for plane in range(itemsize):
            for r0 in range(0, rows, PLANE_CHUNK_ROWS):
                m = min(PLANE_CHUNK_ROWS, rows - r0)
                np.copyto(scratch[:m], src2d[r0 : r0 + m, plane])
                chunk = cobj.compress(scratch[:m])
                if chunk:
                    parts.append(chunk)
        parts.append(cobj.flush())
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def decode_into(self, payload: BytesLike, out: BytesLike, itemsize: int) -> None:
        _check_itemsize(itemsize)
        src = _byte_view(payload, "payload")
        dst = _writable_byte_view(out)
        if len(dst) % itemsize:
            raise ValueError(f"out is {len(dst)} bytes, not a multiple of itemsize {itemsize}")
        zstd_check_frame(src, len(dst))
        zstd_stream_into(src, itemsize if len(dst) else 1, dst)


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------

_BY_NAME: dict[str, type[Codec]] = {}
_BY_ID: dict[int, type[Codec]] = {}
_REGISTRY_LOCK = threading.Lock()


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Add a codec class to the registry (usable as a class decorator); returns ``cls``.

    Registering the same class again is a no-op. Raises ``ValueError`` when its id or name is
    already taken by another class, ``TypeError`` when ``cls`` is not a :class:`Codec` subclass
    with an int ``codec_id`` in [0, 65535] (stored as u16) and a non-empty str ``name``.
    """
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise TypeError(f"register_codec expects a Codec subclass, got {cls!r}")
    codec_id = getattr(cls, "codec_id", None)
    name = getattr(cls, "name", None)
    if isinstance(codec_id, bool) or not isinstance(codec_id, int) or not 0 <= codec_id <= 0xFFFF:
        raise TypeError(f"{cls.__name__}.codec_id must be an int in [0, 65535], got {codec_id!r}")
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__}.name must be a non-empty str, got {name!r}")
    with _REGISTRY_LOCK:
        by_id, by_name = _BY_ID.get(codec_id), _BY_NAME.get(name)
        if by_id is cls and by_name is cls:
            return cls
        if by_id is not None:
            raise ValueError(f"codec id {codec_id} is already registered to {by_id.__name__}")
        if by_name is not None:
            raise ValueError(f"codec name {name!r} is already registered to {by_name.__name__}")
        _BY_ID[codec_id] = cls
        _BY_NAME[name] = cls
    return cls


def registered_codecs() -> dict[str, int]:
    """``{name: codec_id}`` of every registered codec, by id."""
    return {cls.name: cid for cid, cls in sorted(_BY_ID.items())}


def _known() -> str:
    return ", ".join(f"{name!r} ({cid})" for name, cid in registered_codecs().items())


def _lookup(name_or_id: str | int) -> type[Codec]:
    if isinstance(name_or_id, bool):
        cls = None
    elif isinstance(name_or_id, int):
        cls = _BY_ID.get(name_or_id)
    elif isinstance(name_or_id, str):
        cls = _BY_NAME.get(name_or_id)
    else:
        cls = None
    if cls is None:
        raise UnknownCodecError(f"unknown codec {name_or_id!r}; known codecs: {_known()}")
    return cls


def _construct(cls: type[Codec], params: Mapping[str, Any]) -> Codec:
    unknown = sorted(set(params) - set(cls.params))
    if unknown:
        accepted = ", ".join(cls.params) or "none"
        raise ConfigError(
            f"codec {cls.name!r} does not take parameter(s) {', '.join(map(repr, unknown))}; "
            f"accepted: {accepted}"
        )
    return cls(**params)


def get_codec(name_or_id: str | int, **params: Any) -> Codec:
    """The codec registered as ``name_or_id`` (a name such as ``"zstd"`` or an id such as ``1``).

    Raises :class:`~ectier.errors.UnknownCodecError` (naming the value and the known codecs) for an
    unregistered name or id, :class:`~ectier.errors.ConfigError` for an unknown or out-of-range
    parameter (both are ``ValueError``).
    """
    return _construct(_lookup(name_or_id), params)


def codec_from_config(config: Mapping[str, Any]) -> Codec:
    """Inverse of :meth:`Codec.get_config`: ``{"name": "zstd", "level": 3}`` -> ``ZstdCodec(level=3)``.

    Raises :class:`~ectier.errors.ConfigError` when ``name`` is missing, else as :func:`get_codec`.
    """
    if not isinstance(config, Mapping) or "name" not in config:
        raise ConfigError(f"codec config must be a mapping with a 'name' key, got {config!r}")
    params = dict(config)
    return get_codec(params.pop("name"), **params)


for _cls in (RawCodec, ZstdCodec, PlaneZstdCodec):
    register_codec(_cls)
del _cls
