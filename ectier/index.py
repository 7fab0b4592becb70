"""Bookkeeping of one arena-backed memory tier: slots, states, pins, bytes. Pure Python.

The index knows which entries a tier holds, where their bytes lie in the arena (extents of
blocks), their lifecycle state and how many readers pin them. It never touches the bytes.

Lifecycle of a slot (docs/architecture.md, "Entry lifecycle")::

    reserve ──> RESERVED ──commit──> COMMITTED ──evict──> LEAVING ──remove──> (blocks freed
       │        (invisible)  │       (visible,            (readable while       when the last
       └─ None if short      abort   evictable when       it demotes; never      pin drops)
                             (freed)  unpinned)            chosen again)

- ``reserve`` accounts the bytes at once, so concurrent puts never over-commit the budget.
- Readers ``pin`` a visible slot while they copy from it; a pinned slot is never chosen as a
  victim and its blocks are not freed before the last ``unpin``.
- A key is visible only through ``commit``: a half-written entry is never served.

Not thread-safe: the owning cache holds its lock around every call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from .arena import BlockAllocator, Extent
from .entry import EntryMeta, EntryState
from .policy import EvictionPolicy, LRUPolicy

__all__ = ["Slot", "ArenaIndex"]


@dataclass(eq=False, slots=True)
class Slot:
    """One entry's place in a memory tier.

    Fields:
        digest: 32-byte identity (:func:`ectier.entry.entry_digest`).
        meta: dtype, shape, nbytes, namespace and key.
        version: write version (:func:`ectier.entry.next_version`).
        extents: block runs holding the bytes, in order.
        alloc_bytes: blocks x block size, what the slot costs the budget.
        state: :class:`~ectier.entry.EntryState`.
        pins: readers (and demoters) currently copying from it.
        visible: True while the index maps ``digest`` to this slot.
        lower_copy: True when the next tier down holds this same version (eviction is then free).
        cost_s: seconds a miss on this entry costs (recompute), given to the policy at commit;
            ``None`` = unknown (the policy's default).
        pending_write: the tier's copy handle of the write that filled the slot, while the tier
            tracks it (the GPU tier: readers check it for a failed copy); ``None`` otherwise.
        view: the tier's zero-copy tensor view of the slot's bytes, made at its first copy
            (the host tier: the entry's dtype and shape over its one run); ``None`` until then.
    """

    digest: bytes
    meta: EntryMeta
    version: int
    extents: list[Extent]
    alloc_bytes: int
    state: EntryState = EntryState.RESERVED
    pins: int = 0
    visible: bool = False
    lower_copy: bool = False
    cost_s: float | None = None
    freed: bool = field(default=False, repr=False)
    pending_write: object = field(default=None, repr=False)
    view: object = field(default=None, repr=False)


class ArenaIndex:
    """Slots, LRU order and block accounting of one arena tier of ``capacity_bytes``.

    Args:
        capacity_bytes: byte budget; rounded down to whole blocks.
        block_bytes: allocation unit in bytes.
        policy: eviction policy (default :class:`~ectier.policy.LRUPolicy`).
    """

    def __init__(self, capacity_bytes: int, block_bytes: int, policy: EvictionPolicy | None = None) -> None:
        if block_bytes <= 0:
            raise ValueError(f"block_bytes: must be > 0, got {block_bytes}")
        self.block_bytes = block_bytes
        self.allocator = BlockAllocator(capacity_bytes // block_bytes)
        #: usable budget in bytes (whole blocks)
        self.capacity_bytes = self.allocator.nblocks * block_bytes
        self.policy = policy if policy is not None else LRUPolicy()
        self._slots: dict[bytes, Slot] = {}
        self.reserved_bytes = 0  # reserved, not yet committed

    # ---------------------------------------------------------------------------- accounting

    @property
    def used_bytes(self) -> int:
        """Bytes held by reserved, committed and leaving slots (block-rounded)."""
        return self.allocator.used_blocks * self.block_bytes

    @property
    def free_bytes(self) -> int:
        return self.allocator.free_blocks * self.block_bytes

    def alloc_bytes(self, nbytes: int) -> int:
        """Budget an entry of ``nbytes`` costs: whole blocks."""
        return -(-nbytes // self.block_bytes) * self.block_bytes

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` could ever fit this tier (i.e. within its whole budget)."""
        return -(-nbytes // self.block_bytes) * self.block_bytes <= self.capacity_bytes

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, digest: object) -> bool:
        return digest in self._slots

    def slots(self) -> list[Slot]:
        """Visible slots, least recently used first."""
        return [self._slots[d] for d in self.policy if d in self._slots] + [
            s for s in self._slots.values() if s.state is EntryState.LEAVING
        ]

    # ----------------------------------------------------------------------------- lifecycle

    def runs(self, slot: Slot) -> Iterator[tuple[int, int, int]]:
        """Yield ``(arena_offset, entry_offset, length)`` byte runs of ``slot``'s blocks, in entry
        order (offsets and lengths in bytes; the last run stops at the entry's end)."""
        done = 0
        block = self.block_bytes
        total = slot.meta.nbytes
        for first, count in slot.extents:
            length = min(count * block, total - done)
            if length <= 0:
                break
            yield first * block, done, length
            done += length

    def reserve(self, digest: bytes, meta: EntryMeta, version: int, cost_s: float | None = None) -> Slot | None:
        """Allocate blocks for ``meta.nbytes``; ``None`` if the free blocks do not suffice now.
        ``cost_s``: the slot's recompute seconds (:attr:`Slot.cost_s`)."""
        nblocks = -(-meta.nbytes // self.block_bytes)
        if nblocks > self.allocator.free_blocks:
            return None
        extents = self.allocator.alloc(nblocks)
        if extents is None:
            return None
        alloc_bytes = nblocks * self.block_bytes
        self.reserved_bytes += alloc_bytes
        return Slot(digest, meta, version, extents, alloc_bytes, cost_s=cost_s)

    def abort(self, slot: Slot) -> None:
        """Give a reserved slot's blocks back."""
        if slot.state is not EntryState.RESERVED or slot.freed:
            raise ValueError(f"abort: slot is {'aborted' if slot.freed else slot.state.value}, not reserved")
        self.reserved_bytes -= slot.alloc_bytes
        self._release(slot)

    def commit(self, slot: Slot) -> Slot | None:
        """Make a reserved slot visible under its digest; returns the slot it replaced (now removed)."""
        if slot.state is not EntryState.RESERVED or slot.freed:
            # an aborted slot keeps state RESERVED but its blocks may already hold another entry
            raise ValueError(f"commit: slot is {'aborted' if slot.freed else slot.state.value}, not reserved")
        self.reserved_bytes -= slot.alloc_bytes
        digest, slots = slot.digest, self._slots
        old = slots.get(digest)
        slot.state = EntryState.COMMITTED
        slot.visible = True
        slots[digest] = slot
        if old is None:
            self.policy.add(digest, slot.alloc_bytes, slot.cost_s)
            return None
        # remove(old), inlined (every overwrite): its place in the map and the policy is the new slot's
        self.policy.replace(digest, slot.alloc_bytes, slot.cost_s)
        old.visible = False
        old.state = EntryState.LEAVING  # (a visible slot is committed or leaving)
        if old.pins == 0:
            self._release(old)
        return old

    def lookup(self, digest: bytes) -> Slot | None:
        """The visible slot for ``digest`` (committed or leaving), or ``None``."""
        return self._slots.get(digest)

    def touch(self, slot: Slot) -> None:
        """Record a hit (moves the slot to the most-recently-used end)."""
        if slot.state is EntryState.COMMITTED:
            self.policy.touch(slot.digest)

    def pin(self, slot: Slot) -> None:
        """A reader starts copying from ``slot``: it is neither evicted nor freed until unpinned."""
        if slot.freed:
            raise ValueError("pin: slot was already freed")
        slot.pins += 1

    def unpin(self, slot: Slot) -> bool:
        """A reader is done; frees the blocks if the slot was removed meanwhile. True if freed."""
        if slot.pins <= 0:
            raise ValueError("unpin: slot is not pinned")
        slot.pins -= 1
        if slot.pins == 0 and not slot.visible and slot.state is not EntryState.RESERVED:
            self._release(slot)
            return True
        return False

    def victims(self, need_bytes: int, *, clean_only: bool = False) -> list[Slot] | None:
        """Mark LRU victims covering ``need_bytes`` as LEAVING (all or nothing).

        Pinned slots are skipped; with ``clean_only`` so are slots whose bytes the next tier down
        does not hold (``lower_copy`` false), so that evicting them costs no write. Victims stay
        visible (readable) until :meth:`remove`.
        """
        if clean_only:
            chosen = self.policy.victims(
                need_bytes, protected=lambda d: self._slots[d].pins > 0 or not self._slots[d].lower_copy
            )
        else:
            chosen = self.policy.victims(need_bytes, protected=lambda d: self._slots[d].pins > 0)
        if chosen is None:
            return None
        out = []
        for d in chosen:
            slot = self._slots[d]
            self.policy.remove(d)
            slot.state = EntryState.LEAVING
            out.append(slot)
        return out

    def remove(self, slot: Slot) -> bool:
        """Make ``slot`` invisible; its blocks are freed now, or at the last unpin. True if freed now."""
        if self._slots.get(slot.digest) is slot:
            del self._slots[slot.digest]
            self.policy.remove(slot.digest)
        if not slot.visible:
            return False
        slot.visible = False
        if slot.state is EntryState.COMMITTED:
            slot.state = EntryState.LEAVING
        if slot.pins == 0:
            self._release(slot)
            return True
        return False

    def evictable_bytes(self) -> int:
        """Bytes of committed, unpinned slots (what eviction could free right now)."""
        return sum(s.alloc_bytes for s in self._slots.values() if s.state is EntryState.COMMITTED and s.pins == 0)

    def _release(self, slot: Slot) -> None:
        if slot.freed:
            raise ValueError("slot freed twice")
        slot.freed = True
        self.allocator.free(slot.extents)
