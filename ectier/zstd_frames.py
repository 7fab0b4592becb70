"""zstd frames of the NVMe tier's payloads: the strict checks of one frame and a streaming decode
straight into the caller's buffer, optionally merging byte planes (used by :mod:`ectier.codec`).

A frame is accepted only when it is exactly one zstd frame that declares its content size, equal to
the caller's buffer, so a corrupt or hostile frame cannot write past ``out`` nor allocate more than
it. Every size is in **bytes** unless its name says otherwise. Raises ``CorruptRecordError``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import zstandard

from ectier.errors import CorruptRecordError

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
#: Rows (elements) per chunk when :class:`PlaneZstdCodec` splits into / merges from byte planes:
#: its scratch buffer is this many bytes (1 MiB), which keeps the strided numpy copy at ~2.5 GB/s
#: (a whole-tensor transpose measured 0.4-0.9 GB/s and needs a full-size temporary) and feeds
#: zstd large enough pieces. A payload of more elements is split in several chunks per plane.
PLANE_CHUNK_ROWS = 1 << 20




def zstd_frame_nbytes(frame: memoryview) -> int:
    """Length in bytes of the single zstd frame at the start of ``frame``, by walking its blocks.

    python-zstandard's stream reader returns end-of-stream without an error when the input stops
    inside the 4-byte content checksum, and does not report trailing bytes; walking the block
    headers (3 bytes per block of at most 128 KiB, so ~2,000 steps for 256 MiB) catches both.
    Raises ``zstandard.ZstdError`` or ``CorruptRecordError``.
    """
    if bytes(frame[:4]) != ZSTD_MAGIC:
        raise CorruptRecordError("zstd payload does not start with a zstd frame magic number")
    params = zstandard.get_frame_parameters(frame)
    pos = zstandard.frame_header_size(frame)
    end = len(frame)
    while True:
        if pos + 3 > end:
            raise CorruptRecordError("zstd payload is truncated inside a block header")
        bh = int.from_bytes(frame[pos : pos + 3], "little")
        pos += 3
        block_type = (bh >> 1) & 3
        if block_type == 1:  # RLE: one byte repeated
            pos += 1
        elif block_type == 3:
            raise CorruptRecordError("zstd payload has a reserved block type")
        else:  # raw or compressed
            pos += bh >> 3
        if bh & 1:  # last block
            break
    if params.has_checksum:
        pos += 4
    return pos


def zstd_check_frame(payload: memoryview, raw_nbytes: int) -> None:
    """Check that ``payload`` is exactly one zstd frame declaring ``raw_nbytes`` of content."""
    try:
        content = zstandard.frame_content_size(payload)
        frame_nbytes = zstd_frame_nbytes(payload)
    except zstandard.ZstdError as exc:
        raise CorruptRecordError(f"zstd payload has an invalid frame header: {exc}") from exc
    # python-zstandard reports an absent content size as -1 (CONTENTSIZE_UNKNOWN is the C value).
    if content in (-1, zstandard.CONTENTSIZE_UNKNOWN):
        raise CorruptRecordError("zstd payload does not declare its content size")
    if content != raw_nbytes:
        raise CorruptRecordError(
            f"zstd payload declares {content} bytes of content, the output buffer holds {raw_nbytes}"
        )
    if frame_nbytes != len(payload):
        raise CorruptRecordError(
            f"zstd payload is {len(payload)} bytes but its frame is {frame_nbytes} bytes "
            f"({'truncated' if frame_nbytes > len(payload) else 'trailing data'})"
        )


def _read_exactly(reader: Any, dest: memoryview) -> int:
    """``readinto`` until ``dest`` is full or the stream ends; the number of bytes read."""
    filled = 0
    n = len(dest)
    while filled < n:
        got = reader.readinto(dest[filled:])
        if not got:
            break
        filled += got
    return filled


def zstd_stream_into(payload: memoryview, planes: int, out: memoryview | None, n: int = 0) -> None:
    """Decode one checked zstd frame into ``out``, optionally merging ``planes`` byte planes.

    Decodes straight into ``out`` (``planes == 1``) or through a 1 MiB scratch buffer that is
    scattered into ``out`` plane by plane; never materialises the whole decoded payload twice.
    ``out=None``: decode ``n`` bytes through that scratch buffer and drop them (a check).
    """
    n = n if out is None else len(out)
    dctx = zstandard.ZstdDecompressor()
    try:
        with dctx.stream_reader(payload, read_across_frames=False) as reader:
            if out is None:
                scratch_mv, got = memoryview(bytearray(min(n, PLANE_CHUNK_ROWS))), 0
                while got < n and (k := _read_exactly(reader, scratch_mv[:min(n - got, PLANE_CHUNK_ROWS)])):
                    got += k
                if got != n:
                    raise CorruptRecordError(f"zstd payload decoded to {got} bytes, expected {n}")
            elif planes == 1:
                got = _read_exactly(reader, out)
                if got != n:
                    raise CorruptRecordError(f"zstd payload decoded to {got} bytes, expected {n}")
            else:
                rows = n // planes
                out2d = np.frombuffer(out, dtype=np.uint8).reshape(rows, planes)
                scratch = np.empty(min(rows, PLANE_CHUNK_ROWS), dtype=np.uint8)
                scratch_mv = memoryview(scratch)
                for plane in range(planes):
                    for r0 in range(0, rows, PLANE_CHUNK_ROWS):
                        m = min(PLANE_CHUNK_ROWS, rows - r0)
                        got = _read_exactly(reader, scratch_mv[:m])
                        if got != m:
                            raise CorruptRecordError(
                                f"zstd payload ended early in byte plane {plane} "
                                f"({plane * rows + r0 + got} of {n} bytes decoded)"
                            )
                        out2d[r0 : r0 + m, plane] = scratch[:m]
            # Reading past the end makes zstd consume the frame epilogue and verify the content
            # checksum; any byte here means the frame holds more than it declared.
            if reader.read(1):
                raise CorruptRecordError(f"zstd payload decodes to more than {n} bytes")
    except zstandard.ZstdError as exc:
        raise CorruptRecordError(f"zstd payload failed to decode: {exc}") from exc
