"""The manifest of a chunked Redis object (:mod:`ectier.tiers.remote.redis`): its binary layout,
and the checks a reader applies before it names any chunk key. Sizes in bytes.
"""

from __future__ import annotations

import struct

from ...errors import CorruptRecordError

__all__ = ["MANIFEST", "Manifest", "MIN_CHUNK_BYTES", "MAX_CHUNK_BYTES", "MAX_CLEANUP_CHUNKS"]

#: manifest: magic, version, flags, reserved, chunk count, chunk size, total length, xxh3-64, generation
MANIFEST = struct.Struct("<4sBBHIQQQ16s")
_MAGIC = b"ECRM"
_VERSION = 1
#: the range of ``remote.chunk_bytes`` (ectier/config_remote.py), checked in every manifest read
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 64 * 1024, 512 * 1024 * 1024
#: a delete or an overwrite unlinks the chunks of a manifest declaring more than
#: ``remote.max_entry_bytes`` (one written before that value was lowered) when it names at most
#: this many: bounded names to make, and each unlink bounded by the call's deadline
MAX_CLEANUP_CHUNKS = 1 << 16


class Manifest:
    """One object's manifest (``MANIFEST``): its chunk count and size, total bytes, xxh3-64 of
    the whole object, and a random generation naming its chunks."""

    __slots__ = ("n_chunks", "chunk_bytes", "total", "digest", "generation")

    def __init__(self, n_chunks: int, chunk_bytes: int, total: int, digest: int, generation: bytes) -> None:
        self.n_chunks, self.chunk_bytes, self.total = n_chunks, chunk_bytes, total
        self.digest, self.generation = digest, generation

    def pack(self) -> bytes:
        return MANIFEST.pack(_MAGIC, _VERSION, 0, 0, self.n_chunks, self.chunk_bytes, self.total, self.digest,
                             self.generation)

    @classmethod
    def parse(cls, raw: bytes | None, max_total: int, *, strict: bool = False,
              cleanup: bool = False) -> "Manifest | None":
        """The manifest in ``raw``, or None when it is absent or not a consistent manifest
        (``strict``: raise :class:`CorruptRecordError` for one that is present but not consistent).
        Consistent: chunks of ``MIN_CHUNK_BYTES``..``MAX_CHUNK_BYTES`` (``remote.chunk_bytes``'s
        range) and a total of at most ``max_total`` bytes (``remote.max_entry_bytes``), so a forged
        manifest cannot make a reader name billions of chunk keys. ``cleanup`` (the manifest whose
        chunks a delete or an overwrite unlinks): a larger total too, in at most
        ``MAX_CLEANUP_CHUNKS`` chunks (an object written before ``max_entry_bytes`` was lowered)."""
        if raw is None:
            return None
        fields = MANIFEST.unpack(raw) if len(raw) == MANIFEST.size else None
        why = "not a consistent ectier manifest"
        if fields is not None:
            magic, version, _flags, _res, n, cb, total, digest, gen = fields
            if magic == _MAGIC and version == _VERSION and MIN_CHUNK_BYTES <= cb <= MAX_CHUNK_BYTES \
                    and n == -(-total // cb):
                if total <= max_total or (cleanup and n <= MAX_CLEANUP_CHUNKS):
                    return cls(n, cb, total, digest, gen)
                why = f"declaring {total} bytes, more than remote.max_entry_bytes={max_total}"
        if strict:
            raise CorruptRecordError(f"a manifest of {len(raw)} bytes {why}")
        return None
