"""One NVMe record: how a tensor becomes one (:func:`encode_record`) and the checks every read
of one makes (:func:`verify_record`), shared by :class:`~ectier.tiers.nvme.NvmeTier` and, through
:func:`check_record`, by ``ectier fsck``.

A record is a packed :class:`~ectier.codec.RecordHeader` (magic, format, codec, dtype, shape,
namespace, key, sizes, payload checksum, write version; its own checksum) and a payload (the raw
bytes, or their compressed form). See :mod:`ectier.tiers.nvme` for where they are stored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..codec import Codec, RecordHeader, checksum, get_codec, pack_header, unpack_header, verify_payload
from ..entry import DTYPE_ITEMSIZE, EntryMeta, entry_digest
from ..errors import CorruptRecordError, UnknownCodecError

__all__ = ["EncodedRecord", "CheckedRecord", "encode_record", "verify_record", "check_record"]


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


def encode_record(codec: Codec, meta: EntryMeta, src: torch.Tensor, version: int) -> EncodedRecord:
    """Encode ``src`` (flat ``uint8`` CPU tensor of ``meta.nbytes``) with ``codec`` into a record of
    write version ``version``. No disk I/O."""
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
        payload_checksum=checksum(view),
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
    if payload is None:
        raise CorruptRecordError("payload missing")
    verify_payload(header, payload)
    return CheckedRecord(header, codec, itemsize)


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
        rec.codec.decode_into(payload, np.empty(rec.header.raw_nbytes, dtype=np.uint8), rec.itemsize)
    return rec.header
