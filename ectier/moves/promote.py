"""Promotion: an entry copied up the stack — the one sequence for store-tier (NVMe) hits, the
acquire path that decodes an NVMe hit straight into a host slot, and the upward edges
(nvme → host, nvme → gpu, host → gpu).

Runs on behalf of :class:`~ectier.mover.Mover` (``m``): admission, commits and the error boundary
of every move are the mover's; this module holds what is particular to moving *up*.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..entry import EntryMeta
from ..index import Slot
from ..tiers.arena import ArenaTier
from ..tiers.base import Tier
from .nvme import RETRY

if TYPE_CHECKING:
    from ..mover import Mover

__all__ = ["Promotions"]

_NO_ROOM = object()  # into_host: the admission found no room


class Promotions:
    """The promotion side of the mover (``m``), reached as ``Mover.promote``."""

    def __init__(self, m: "Mover") -> None:
        self.m = m
        self._promotions: dict[tuple[str, str], Callable[..., Any]] = {}
        #: digests being read into a host slot by into_host now, one caller each (m.cond)
        self._reading: set[bytes] = set()
        gpu, host = m.stack.get("gpu"), m.stack.get("host")
        if host is not None:
            self._promotions["nvme", "host"] = self._promote_data_into_host
        if gpu is not None:
            self._promotions["nvme", "gpu"] = self._promote_data_into_device
            if host is not None:
                self._promotions["host", "gpu"] = self._promote_slot_into_device

    def edges(self) -> list[tuple[str, str]]:
        """The registered upward edges ``(source tier, destination tier)``."""
        return list(self._promotions)

    def from_store(self, digest: bytes, ns: str, key: str, version: int, upto: Tier | None,
                           out: torch.Tensor | None = None, *, via_host: bool = True):
        """The one promotion sequence: read ``version`` from the store tier (checked, decoded),
        count the hit, then copy it up the stack, tier by tier, as far as ``upto`` (``None``: no
        promotion). Returns ``(meta, data, promoted)`` — ``data`` a flat ``uint8`` CPU tensor,
        ``promoted`` the names of the tiers that took it — ``None`` on a miss, or ``RETRY``.
        ``out``: the caller's ``get(out=)``; the record is decoded straight into it when it fits.
        ``via_host=False``: no copy into the host tier on the way (it had no room just now)."""
        result = self.m.nvme.read(digest, ns, key, version, out)
        if result is None or result is RETRY:
            return result
        meta, data = result
        self.m.counters.count("nvme", hits=1, hit_bytes=meta.nbytes)
        promoted = set()
        if upto is not None:
            for t in self.m.stack.between(self.m.nvme.tier, upto):
                if not via_host and t.name == "host":
                    continue
                handler = self._promotions.get(("nvme", t.name))
                if handler is not None and self.m.run_move(f"promotion nvme -> {t.name}", handler, digest, meta, version, data):
                    promoted.add(t.name)
        return meta, data, promoted

    def into_host(self, host: ArenaTier, digest: bytes, ns: str, key: str, version: int):
        """An NVMe hit of ``version`` decoded straight into a host slot reserved for it — no
        intermediate tensor (checksum computed while the bytes are read) — committed and pinned
        for the caller (an ``acquire``): the pinned :class:`Slot`; ``None`` on a miss, when no
        clean room could be made, or when the promotion failed (logged); :data:`RETRY` when a
        newer version appeared, or the entry reached the host tier, meanwhile, and once another
        caller's read of the key into the host tier ended (one reads at a time; the others wait
        for it). A slot that is not one run of the arena is filled from a decoded copy instead."""
        rec = self.m.nvme.tier.record(digest)
        if rec is None:
            return None
        with self.m.cond:  # one caller reads a key into the host tier at a time; the others wait for it
            other = digest in self._reading
            if not other:
                self._reading.add(digest)
        if other:
            return self._wait_for_other(digest)
        try:
            got = self._admit_read_commit(host, digest, rec.meta, ns, key, version)
        finally:
            with self.m.cond:
                self._reading.discard(digest)
                self.m.cond.notify_all()
        if got is _NO_ROOM:
            with self.m.cond:  # (admitted nothing: already there, or a newer version, since the lookup)
                moved = host.current(digest, version) is not None or self.m.catalog.version(digest) != version
            return RETRY if moved else None
        return got

    def _admit_read_commit(self, host: ArenaTier, digest: bytes, meta: EntryMeta, ns: str, key: str, version: int):
        slot = self.m.admit(host, digest, meta, version, promotion=True, protect=digest)
        if slot is None:
            return _NO_ROOM
        try:
            got = self.m.run_move("promotion nvme -> host", self._read_into_slot, host, slot, digest, ns, key, version)
        except BaseException:
            self.m.abort(host, slot)
            raise
        if got is None or got is RETRY:
            self.m.abort(host, slot)
            return got
        self.m.counters.count("nvme", hits=1, hit_bytes=meta.nbytes)
        if not self.m.commit(host, slot, promotion=True, pin_after=True).committed:
            return RETRY  # a newer version, or the key was promoted by another reader meanwhile
        self.m.counters.count("host", promotions=1)
        return slot

    def _wait_for_other(self, digest: bytes):
        """Another caller is reading ``digest`` into a host slot (a prefetch, another acquire):
        wait for that read to end (at most ``host.admit_wait_s``; its reservation may be the
        room a second copy would need) and return :data:`RETRY` (the caller finds the entry
        where it is now); ``None`` if it did not end in time."""
        m = self.m
        deadline = time.monotonic() + m.config.host.admit_wait_s
        with m.cond:
            while digest in self._reading:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                m.cond.wait(timeout=min(0.05, remaining))
        return RETRY

    def _read_into_slot(self, host: ArenaTier, slot: Slot, digest: bytes, ns: str, key: str, version: int):
        """Read the record into the reserved ``slot``'s bytes: True, ``None`` (miss) or RETRY."""
        view = host.contiguous_view(slot)
        if view is None:  # several runs of the arena: one scatter read into them, in order
            view = [host.buffer[a:a + n] for a, _, n in host.runs(slot)]
        result = self.m.nvme.read(digest, ns, key, version, into=view)
        if result is None or result is RETRY:
            return result
        meta, data = result
        if meta.nbytes != slot.meta.nbytes:
            return RETRY  # another record replaced the one the slot was sized for
        if data is not None and (isinstance(view, list) or data.data_ptr() != view.data_ptr()):
            host.write(slot, data)  # not decodable in place: copy
        return True

    def from_slot(self, src: ArenaTier, slot: Slot, dst: Tier) -> bool:
        """Copy a pinned slot of ``src`` up into ``dst`` through the registered edge (a failed or
        missing edge is False, never an error)."""
        handler = self._promotions.get((src.name, dst.name))
        return handler is not None and bool(self.m.run_move(f"promotion {src.name} -> {dst.name}", handler, src, slot))

    def from_data(self, target: Tier, digest: bytes, meta: EntryMeta, version: int, data: torch.Tensor) -> bool:
        """Copy CPU bytes of an entry up into ``target`` (the GPU tier) — after a remote fetch."""
        if target.name != "gpu":
            return False
        return bool(self.m.run_move("promotion -> gpu", self._promote_data_into_device, digest, meta, version, data))

    def _promote_data_into_host(self, digest: bytes, meta: EntryMeta, version: int, data: torch.Tensor) -> bool:
        host = self.m.stack.get("host")
        if not host.fits(meta.nbytes):
            return False
        c = self.m.arena.store(host, digest, meta, version, data, promotion=True, protect=digest)
        if c is not None and c.committed:
            self.m.counters.count("host", promotions=1)
            return True
        return False

    def _promote_data_into_device(self, digest: bytes, meta: EntryMeta, version: int, data: torch.Tensor) -> bool:
        gpu = self.m.stack.get("gpu")
        g = self.m.arena.promote_device(gpu, digest, meta, version, data=data)
        if g is not None:
            self.m.unpin(gpu, g)
        return g is not None

    def _promote_slot_into_device(self, host: ArenaTier, slot: Slot) -> bool:
        gpu = self.m.stack.get("gpu")
        g = self.m.arena.promote_device(gpu, slot.digest, slot.meta, slot.version, src_tier=host, src_slot=slot)
        if g is not None:
            self.m.unpin(gpu, g)
        return g is not None
