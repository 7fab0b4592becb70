"""The arena tier: one allocation cut into blocks, shared by the GPU and the host tier.

The one admit loop and the one victim-release path of both memory tiers live here; the GPU and
host modules keep only what differs (allocation, pinning, device, how bytes are copied).
Bookkeeping goes through :class:`~ectier.index.ArenaIndex` (slots, pins, block accounting).
"""

from __future__ import annotations

import abc

from typing import Any, Iterator

import torch

from ..entry import EntryMeta
from ..index import ArenaIndex, Slot
from ..policy import EvictionPolicy
from .base import Admission, Tier

__all__ = ["ArenaTier", "run_pairs"]


class ArenaTier(Tier):
    """A byte budget of ``capacity_bytes`` in ``block_bytes`` blocks over ``self.buffer``.

    Subclasses allocate ``self.buffer`` (a flat ``uint8`` tensor of :attr:`capacity_bytes` bytes)
    and implement :meth:`write` and :meth:`read_into`.
    """

    #: the device of the arena (``None``: host memory)
    device: torch.device | None = None
    is_arena = True

    def __init__(self, capacity_bytes: int, block_bytes: int, policy: EvictionPolicy | None) -> None:
        self.index = ArenaIndex(capacity_bytes, block_bytes, policy)
        self.buffer: torch.Tensor

    @abc.abstractmethod
    def write(self, slot: Slot, src: torch.Tensor):
        """Copy ``src`` (flat ``uint8``, ``slot.meta.nbytes`` long) into the slot's blocks;
        returns ``None`` (done) or a :class:`~ectier.copy.CopyHandle` (enqueued)."""

    @abc.abstractmethod
    def read_into(self, slot: Slot, dst: torch.Tensor):
        """Copy the slot's bytes into ``dst`` (flat ``uint8``); ``None`` (done) or a copy handle."""

    def contiguous_view(self, slot: Slot) -> torch.Tensor | None:
        """The slot's bytes as one zero-copy CPU view, where the tier allows it (host), else ``None``."""
        return None

    # ------------------------------------------------------------------------- accounting
    @property
    def capacity_bytes(self) -> int:
        return self.index.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.index.used_bytes

    def __len__(self) -> int:
        return len(self.index)

    def fits(self, nbytes: int) -> bool:
        idx = self.index  # ArenaIndex.fits, inlined: asked on every put
        return -(-nbytes // idx.block_bytes) * idx.block_bytes <= idx.capacity_bytes

    def describe(self) -> dict[str, Any]:
        return {"capacity_bytes": self.index.capacity_bytes, "used_bytes": self.index.used_bytes,
                "entries": len(self.index)}

    # ------------------------------------------------------------------------- admission
    def admit(self, digest: bytes, meta: EntryMeta, version: int, *, cost_s: float | None = None,
              clean_only: bool = False) -> Admission:
        """Reserve blocks for ``meta.nbytes``, or name the victims whose eviction makes room.

        Victims (least valuable first, all or nothing, unpinned only; with ``clean_only`` only
        entries a lower tier already holds) are marked leaving and pinned for the caller, who
        moves them down and calls :meth:`release_victim` for each. An entry larger than the whole
        budget is refused (``Admission(too_large=True)``) before anything is chosen.
        """
        idx = self.index
        if not idx.fits(meta.nbytes):
            return Admission(too_large=True)
        slot = idx.reserve(digest, meta, version)
        if slot is not None:
            slot.cost_s = cost_s
            return Admission(entry=slot)
        found = idx.victims(idx.alloc_bytes(meta.nbytes) - idx.free_bytes, clean_only=clean_only)
        if found is None:
            return Admission()
        for v in found:
            idx.pin(v)  # the evicting caller's pin: bytes stay valid until moved down
        return Admission(victims=found)

    def release_victim(self, slot: Slot) -> None:
        """Remove an evicted victim and drop the evicting caller's pin (blocks freed at the last pin)."""
        self.index.remove(slot)
        self.index.unpin(slot)

    def commit(self, slot: Slot) -> Slot | None:
        """Make a reserved slot visible; returns the slot it replaced (removed), if any."""
        return self.index.commit(slot)

    def abort(self, slot: Slot) -> None:
        """Give a reserved slot's blocks back."""
        self.index.abort(slot)

    # ------------------------------------------------------------------------- lookup, pins
    def lookup(self, digest: bytes) -> Slot | None:
        """The visible slot of ``digest`` (any version), or ``None``."""
        return self.index.lookup(digest)

    def current(self, digest: bytes, version: int | None) -> Slot | None:
        """The visible slot of ``digest`` if it holds ``version``, else ``None``."""
        s = self.index.lookup(digest)
        return s if s is not None and version is not None and s.version == version else None

    def holds(self, digest: bytes, version: int) -> bool:
        return self.current(digest, version) is not None

    def stored_version(self, digest: bytes) -> int | None:
        s = self.index.lookup(digest)
        return s.version if s is not None else None

    def pin(self, slot: Slot) -> None:
        self.index.pin(slot)

    def unpin(self, slot: Slot) -> bool:
        """Drop one pin; True if that freed the slot's blocks (waiters for room should wake)."""
        return self.index.unpin(slot)

    def touch(self, slot: Slot) -> None:
        self.index.touch(slot)

    def remove(self, slot: Slot) -> bool:
        """Make ``slot`` invisible; True if its blocks were freed now."""
        return self.index.remove(slot)

    def remove_if(self, digest: bytes, pred) -> bool:
        """Remove the visible slot of ``digest`` when ``pred(slot)``; True if blocks were freed."""
        s = self.index.lookup(digest)
        return s is not None and pred(s) and self.index.remove(s)

    def remove_older(self, digest: bytes, version: int) -> bool:
        """Remove ``digest``'s visible slot if it holds a version older than ``version``; True if
        blocks were freed now."""
        s = self.index.lookup(digest)
        return s is not None and s.version < version and self.index.remove(s)

    def delete(self, digest: bytes) -> bool:
        """Remove ``digest``'s visible slot; True if blocks were freed now."""
        return self.remove_if(digest, lambda s: True)

    def slots(self) -> list[Slot]:
        """Visible slots, least valuable first."""
        return self.index.slots()

    def total_pins(self) -> int:
        return sum(s.pins for s in self.index.slots())

    # ------------------------------------------------------------------------- bytes
    def runs(self, slot: Slot) -> Iterator[tuple[int, int, int]]:
        """``(arena_offset, entry_offset, length)`` byte runs of ``slot``, in entry order."""
        return self.index.runs(slot)

    def byte_extents(self, slot: Slot) -> list[tuple[int, int]]:
        """``(arena byte offset, length)`` runs holding the slot's bytes, in entry order."""
        return [(arena_off, length) for arena_off, _, length in self.runs(slot)]

    def pairs_with(self, slot: Slot, flat: torch.Tensor, *, into_arena: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(dst, src)`` byte views between ``slot``'s runs and the flat ``uint8`` entry ``flat``."""
        if into_arena:
            return [(self.buffer[a : a + n], flat[o : o + n]) for a, o, n in self.runs(slot)]
        return [(flat[o : o + n], self.buffer[a : a + n]) for a, o, n in self.runs(slot)]


def run_pairs(dst: ArenaTier, dst_slot: Slot, src: ArenaTier, src_slot: Slot) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pair two arenas' runs of one entry (their block sizes may differ) into ``(dst, src)`` byte
    views of equal length covering the entry."""
    dr, sr = list(dst.runs(dst_slot)), list(src.runs(src_slot))
    pairs = []
    i = j = 0
    while i < len(dr) and j < len(sr):
        da, do, dn = dr[i]
        sa, so, sn = sr[j]
        lo, hi = max(do, so), min(do + dn, so + sn)
        if hi > lo:
            pairs.append((dst.buffer[da + lo - do : da + hi - do], src.buffer[sa + lo - so : sa + hi - so]))
        if do + dn <= so + sn:
            i += 1
        else:
            j += 1
    return pairs
