"""One NVMe record: how a tensor becomes one (:func:`encode_record`) and the checks every read
of one makes (:func:`verify_record`), shared by :class:`~ectier.tiers.nvme.NvmeTier` and, through
:func:`check_record`, by ``ectier fsck``.

A record is a packed :class:`~ectier.codec.RecordHeader` (magic, format, codec, dtype, shape,
namespace, key, sizes, payload checksum, write version; its own checksum) and a payload (the raw
bytes, or their compressed form). In layout v2 the index value is the packed header followed by
the payload's :class:`~ectier.tiers.nvme_segment.Location` (:func:`pack_index_value`,
:func:`parse_index_value`); the payload lives in the segment file. See :mod:`ectier.tiers.nvme`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..codec import (Codec, RecordHeader, checksum, get_codec, header_nbytes, pack_header, unpack_header,
                     verify_payload)
from ..entry import DTYPE_ITEMSIZE, EntryMeta, entry_digest
from ..errors import CorruptRecordError, UnknownCodecError
from .nvme_segment import Location, pack_location, unpack_location

__all__ = ["EncodedRecord", "CheckedRecord", "encode_record", "verify_record", "check_record",
           "pack_index_value", "parse_index_value", "check_index_value", "check_header"]


@dataclass(frozen=True)
class EncodedRecord:
    """A record ready to write: packed header, payload (zero-copy for the raw codec), sizes."""

    header: RecordHeader
    header_bytes: bytes
    payload: object  # bytes-like
    keepalive: object  # the source the payload may point into

    @property
    def stored_bytes(self) -> int:
        return len(self.header_bytes) + self.header.payload_nbytes


def encode_record(codec: Codec, meta: EntryMeta, src: torch.Tensor, version: int, *,
                  with_checksum: bool = True) -> EncodedRecord:
    """Encode ``src`` (flat ``uint8`` CPU tensor of ``meta.nbytes``) with ``codec`` into a record of
    write version ``version``. No disk I/O. ``with_checksum=False`` leaves ``payload_checksum`` 0
    for a writer that computes it while it copies the payload (the NVMe tier: one pass)."""
    data = src.numpy() if src.numel() else np.empty(0, dtype=np.uint8)
    payload = codec.encode(data, meta.itemsize)
    view = memoryview(payload)
    header = RecordHeader(
        codec_id=codec.codec_id,
        dtype=meta.dtype,
        shape=tuple(meta.shape),
        namespace=meta.namespace,
        key=meta.key,
        raw_nbytes=meta.nbytes,
        payload_nbytes=view.nbytes,
        payload_checksum=checksum(view) if with_checksum else 0,
        version=version,
        created_ns=time.time_ns(),
        codec_config={k: v for k, v in codec.get_config().items() if k != "name"},
    )
    return EncodedRecord(header, pack_header(header), view, src)


class CheckedRecord(NamedTuple):
    """A stored record that passed :func:`verify_record`, with what decoding it needs."""

    header: RecordHeader
    codec: Codec  # the codec its header names
    itemsize: int  # bytes per element of its dtype


def verify_record(identity: bytes | tuple[str, str], raw_header: object, payload: object | None, *,
                  codec: Codec | None = None) -> CheckedRecord:
    """The checks of one stored record, short of decoding its payload.

    Args:
        identity: the 32-byte digest the record is stored under, or the ``(namespace, key)`` a read
            asked for; the header must name the same entry.
        raw_header: the stored header bytes (bytes-like).
        payload: the stored payload bytes (bytes-like), or ``None`` if none was found.
        codec: a codec to use when the header names it (saves making one per read).

    Returns:
        The parsed header, its codec and the item size of its dtype (bytes).

    Raises:
        CorruptRecordError: the header fails its own checks or does not belong to ``identity``, its
            dtype/shape/size disagree, its codec is unknown, the payload is missing, or the payload's
            length or xxh3-64 checksum fails.
    """
    header = unpack_header(raw_header)
    rec = check_header(identity, header, codec)
    if payload is None:
        raise CorruptRecordError("payload missing")
    verify_payload(header, payload)
    return rec


def check_record(digest: bytes, raw_header: object, payload: object | None, *, decode: bool = False) -> RecordHeader:
    """Make the checks a read makes on one stored record, outside a tier (``ectier fsck``).

    Args:
        digest: the 32-byte key the record is stored under.
        raw_header: the stored header bytes (bytes-like).
        payload: the stored payload bytes (bytes-like), or ``None`` if none was found.
        decode: also decode the payload into a scratch buffer (catches a damaged zstd frame whose
            checksum still matches: never seen, but a read would catch it too).

    Returns:
        The parsed :class:`~ectier.codec.RecordHeader`.

    Raises:
        CorruptRecordError: the header fails its own checks or does not belong to ``digest``, its
            dtype/shape/size disagree, its codec is unknown, the payload is missing, or the payload's
            length or xxh3-64 checksum (or its decoding) fails.
    """
    rec = verify_record(digest, raw_header, payload)
    if decode:
        rec.codec.check(payload, rec.header.raw_nbytes, rec.itemsize)  # (memory: the codec's scratch)
    return rec.header


def pack_index_value(header: RecordHeader, loc: Location) -> bytes:
    """The LMDB index value of a layout-v2 record: packed header, then the payload's location."""
    return pack_header(header) + pack_location(loc)


def parse_index_value(raw: object) -> tuple[RecordHeader, Location]:
    """Split and check an index value (:func:`pack_index_value`).

    Raises:
        CorruptRecordError: the header or the location fails its checks, or the location is missing
            (a layout-v1 value: header only).
    """
    mv = memoryview(raw)
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    n = header_nbytes(mv)
    if n > len(mv):
        raise CorruptRecordError(f"record header length mismatch: declares {n} bytes, got {len(mv)}")
    header = unpack_header(mv[:n])
    return header, unpack_location(mv[n:])


def check_index_value(identity: bytes | tuple[str, str], raw: object, *,
                      codec: Codec | None = None) -> tuple[CheckedRecord, Location]:
    """The checks of a layout-v2 index value, short of reading its payload: header and location
    (:func:`parse_index_value`), identity, dtype/shape/size, codec, and that the location holds
    the payload length.

    Raises:
        CorruptRecordError: any check fails.
    """
    header, loc = parse_index_value(raw)
    rec = check_header(identity, header, codec)
    if loc.alloc_bytes < header.payload_nbytes:
        raise CorruptRecordError("payload location is smaller than the payload")
    return rec, loc


def check_header(identity: bytes | tuple[str, str], header: RecordHeader, codec: Codec | None) -> CheckedRecord:
    """The checks of a parsed header short of its payload: it names ``identity`` (a 32-byte digest,
    or the ``(namespace, key)`` a read asked for), its dtype is one ectier stores, its raw size is
    its shape times the dtype's item size (bytes), and its codec is registered (``codec``: the
    tier's own, used when the header names it).

    Raises:
        CorruptRecordError: naming the check that failed.
    """
    if isinstance(identity, tuple):
        if (header.namespace, header.key) != identity:
            raise CorruptRecordError("record identity does not match the requested key")
    elif entry_digest(header.namespace, header.key) != identity:
        raise CorruptRecordError("header identity does not match its digest")
    itemsize = DTYPE_ITEMSIZE.get(header.dtype)
    if itemsize is None:
        raise CorruptRecordError(f"unknown dtype {header.dtype!r}")
    expected = itemsize
    for d in header.shape:
        expected *= d
    if expected != header.raw_nbytes:
        raise CorruptRecordError("raw size does not match dtype and shape")
    if codec is None or header.codec_id != codec.codec_id:
        try:
            codec = get_codec(header.codec_id)
        except UnknownCodecError as exc:
            raise CorruptRecordError(str(exc)) from None
    return CheckedRecord(header, codec, itemsize)
