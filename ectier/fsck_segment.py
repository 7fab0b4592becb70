"""What ``ectier fsck`` reads of a layout-v2 store outside LMDB: the segment file
(:class:`Segment`, plain ``pread``), and which index entries claim blocks a newer one holds
(:func:`reused_extents`). See :mod:`ectier.fsck`."""

from __future__ import annotations

import os
from pathlib import Path

from .tiers.nvme_segment import BLOCK_BYTES, SEGMENT_NAME, Location

__all__ = ["Segment", "reused_extents"]


class Segment:
    """The segment file of a layout-v2 store, read with plain ``pread`` (absent: every read is None)."""

    def __init__(self, store: Path) -> None:
        try:
            self._f = open(store / SEGMENT_NAME, "rb")
        except OSError:
            self._f = None

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc: object) -> None:
        if self._f is not None:
            self._f.close()

    def payload(self, loc: Location, nbytes: int) -> bytes | None:
        """The ``nbytes`` payload bytes at ``loc``; ``None`` if the file is missing or too short."""
        if self._f is None:
            return None if nbytes else b""
        parts, left = [], nbytes
        for start, count in loc.extents:
            n = min(left, count * BLOCK_BYTES)
            part = os.pread(self._f.fileno(), n, start * BLOCK_BYTES)
            if len(part) != n:
                return None
            parts.append(part)
            left -= n
        return b"".join(parts) if left == 0 else None


def reused_extents(entries: list[tuple[bytes, int, Location]]) -> set[bytes]:
    """Digests of the ``(digest, version, location)`` entries that share a block with a newer entry."""
    owner: dict[int, tuple[int, bytes]] = {}  # block -> (version, digest) of the newest entry holding it
    for digest, version, loc in entries:
        for start, count in loc.extents:
            for b in range(start, start + count):
                if b not in owner or owner[b][0] < version:
                    owner[b] = (version, digest)
    return {digest for digest, _, loc in entries
            if any(owner[b][1] != digest for s, n in loc.extents for b in range(s, s + n))}
