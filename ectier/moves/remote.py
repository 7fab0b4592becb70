"""Moves to and from the remote tier: write-through after a put (in the background, never on the
caller's path) and fetch after a local miss (the entry then lands in the host tier, or NVMe).

Every function here runs on behalf of :class:`~ectier.mover.Mover` (``m``); remote I/O runs
outside the cache lock, bounded by ``remote.timeout_s`` per call.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from ..entry import EntryMeta
from ..errors import TierWriteError
from ..tiers.nvme import RAW_CODEC_ID
from ..tiers.nvme_reader import mark_background
from ..tiers.remote.tier import RemoteTier
from .nvme import RETRY

if TYPE_CHECKING:
    from ..mover import Mover
    from ..tiers.arena import ArenaTier
    from ..tiers.base import Tier

__all__ = ["RemoteMoves", "MAX_BACKLOG"]

log = logging.getLogger(__name__)

#: write-throughs queued at most; more are skipped (counted ``skipped_backlog``) rather than let a
#: slow store hold memory without bound
MAX_BACKLOG = 256


class RemoteMoves:
    """The remote tier's side of every move (``m``: the mover; ``tier``: the remote tier)."""

    def __init__(self, m: "Mover", tier: RemoteTier) -> None:
        self.m = m
        self.tier = tier
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._queued = 0
        self._idle = threading.Condition(self._lock)

    # ------------------------------------------------------------------------- write-through
    def write_later(self, src: "ArenaTier | Tier", digest: bytes, version: int, nbytes: int) -> None:
        """Queue the write of ``version`` of ``digest`` (committed in ``src``: a memory tier, or the
        NVMe tier for a put that went straight there) to the remote tier."""
        if not self.tier.config.write_through:
            return
        if not self.tier.fits(nbytes):
            self.m.counters.count("remote", skipped_too_large=1)
            return
        with self._lock:
            if self._queued >= MAX_BACKLOG:
                self.m.counters.count("remote", skipped_backlog=1)
                return
            self._queued += 1
            if self._pool is None:
                self._pool = ThreadPoolExecutor(2, thread_name_prefix="ectier-remote",
                                                initializer=mark_background)
            pool = self._pool
        pool.submit(self._write, src, digest, version)

    def _write(self, src: "ArenaTier | Tier", digest: bytes, version: int) -> None:
        m = self.m
        try:
            if not src.is_arena:
                self._write_stored(digest, version)
                return
            with m.cond:
                slot = src.current(digest, version)
                if slot is None:
                    return  # replaced, deleted or evicted meanwhile: a newer put writes its own
                src.pin(slot)
            try:
                data = m.arena.cpu_bytes(src, slot)
                if data is not None and self.tier.write(slot.meta, data, version, digest,
                                                        payload_checksum=self._known_checksum(digest, version)):
                    m.counters.count("remote", puts=1, put_bytes=slot.meta.nbytes)
            finally:
                m.unpin(src, slot)
        except Exception as exc:  # noqa: BLE001 - a background move: logged, never raised into anyone
            log.warning("remote write-through failed: %s", exc)
        finally:
            with self._lock:
                self._queued -= 1
                self._idle.notify_all()

    def _write_stored(self, digest: bytes, version: int) -> None:
        """Write through an entry that only NVMe holds: read its record back (checked), unless a
        newer version replaced it meanwhile."""
        m = self.m
        rec = m.nvme.tier.record(digest)
        if rec is None or rec.version != version:
            return  # replaced, deleted or evicted meanwhile
        got = m.nvme.read(digest, rec.header.namespace, rec.header.key, version)
        if got is None or got is RETRY:
            return
        meta, data = got
        if self.tier.write(meta, data, version, digest, payload_checksum=self._known_checksum(digest, version)):
            m.counters.count("remote", puts=1, put_bytes=meta.nbytes)

    def _known_checksum(self, digest: bytes, version: int) -> int | None:
        """The xxh3-64 of the raw bytes of ``version`` of ``digest`` when the NVMe tier's record of
        that version stores them uncompressed (its header's payload checksum, computed while those
        bytes were written; every read checks it), else ``None`` (the remote put computes it)."""
        nvme = self.m.nvme
        rec = nvme.tier.record(digest) if nvme is not None else None
        if rec is None or rec.version != version:
            return None
        h = rec.header
        if h.codec_id != RAW_CODEC_ID or h.payload_nbytes != h.raw_nbytes:
            return None  # a compressed payload: its checksum is not that of the raw bytes
        return h.payload_checksum

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write-through ran; False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._queued == 0, timeout_s)

    def close(self) -> None:
        self.drain(timeout_s=2 * self.tier.config.timeout_s + 1)
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------- fetch
    def fetch(self, digest: bytes, ns: str, key: str, target) -> tuple[EntryMeta, torch.Tensor] | None:
        """After a local miss: read the entry from the remote tier, place it locally (the host
        tier if it fits, else NVMe; on into ``target``, the GPU tier, when given) as the key's
        current version unless a newer one appeared meanwhile. ``(meta, data)`` or ``None``."""
        m = self.m
        got = self.tier.fetch(digest, ns, key)
        if got is None:
            m.counters.count("remote", misses=1)
            return None
        header, data = got
        meta = EntryMeta(header.namespace, header.key, header.dtype, tuple(header.shape), header.raw_nbytes)
        m.counters.count("remote", hits=1, hit_bytes=meta.nbytes)
        self._place(digest, meta, header.version, data, target)
        return meta, data

    def _place(self, digest: bytes, meta: EntryMeta, version: int, data: torch.Tensor, target) -> None:
        m = self.m
        host = m.stack.get("host")
        placed = False
        if host is not None and host.fits(meta.nbytes):
            c = m.run_move("promotion remote -> host", m.arena.store, host, digest, meta, version, data,
                           promotion=False)
            placed = c is not None and c.committed
        if not placed and m.nvme is not None and m.nvme.tier.fits(meta.nbytes):
            try:
                placed = m.nvme.store(digest, meta, version, data, register=True)
            except TierWriteError as exc:
                log.warning("promotion remote -> nvme failed: %s", exc)
        if placed and target is not None:
            m.promote.from_data(target, digest, meta, version, data)

    def delete(self, digest: bytes) -> None:
        """Remove the remote copy (best effort: a store that is down keeps it until overwritten)."""
        self.tier.delete(digest)
