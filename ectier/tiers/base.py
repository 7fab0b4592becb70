"""The Tier protocol: what every tier of a :class:`~ectier.cache.TieredCache` offers.

A tier stores, fetches and accounts its own bytes. It never calls another tier, the cache or the
mover: choosing what moves where is the mover's business (``ectier/mover.py``), and the order of
tiers is the stack's (``ectier/stack.py``). Every method that changes bookkeeping runs under the
cache's one lock (the catalog's ``cond``); copies and I/O run outside it.

Lifecycle of an entry in a tier::

    admit ──> Admission(entry)  ── write / copy ──> commit (visible)   or   abort (room returned)
          └─> Admission(victims) : the caller moves the victims down (or drops them), releases
                                   them, and asks again
          └─> Admission()        : no room now (everything evictable is pinned)

Admission refuses an entry larger than the tier's whole budget before evicting anything
(:meth:`Tier.fits`), in the shape of cachetools' ``Cache.__setitem__``.
"""

from __future__ import annotations

import abc
from typing import Any

__all__ = ["Tier", "Admission"]


class Admission:
    """The answer of :meth:`Tier.admit`.

    Exactly one of: ``entry`` (room reserved: the tier's handle of the invisible entry), ``victims``
    (no room yet: entries the caller must move down and release first — pinned for the caller),
    ``too_large`` (larger than the tier's whole budget: never admitted, nothing evicted), or none
    (no room can be made now).
    """

    __slots__ = ("entry", "victims", "too_large")

    def __init__(self, entry: Any = None, victims: list | tuple = (), too_large: bool = False) -> None:
        self.entry = entry
        self.victims = victims
        self.too_large = too_large

    @property
    def granted(self) -> bool:
        return self.entry is not None

    @property
    def blocked(self) -> bool:
        return self.entry is None and not self.victims


class Tier(abc.ABC):
    """One tier of the stack. Subclasses: :class:`~ectier.tiers.arena.ArenaTier` (GPU and host
    memory), :class:`~ectier.tiers.nvme.NvmeTier`.

    Every tier answers the questions below (no I/O). How bytes get in and out differs by kind:
    a memory tier admits (``admit`` → victims or a reserved slot), copies (``write`` /
    ``read_into``, returning a copy handle or ``None`` when done), then ``commit`` / ``abort``, and
    readers ``pin`` / ``unpin``; the NVMe tier ``encode`` s, ``write`` s and ``read`` s whole
    records in transactions (its readers need no pin: LMDB snapshots), with its budget in
    :class:`~ectier.tiers.nvme_index.NvmeIndex`.

    Attributes:
        name: the tier's name in configs, stats and move handlers (``"gpu"``, ``"host"``, ``"nvme"``).
    """

    name: str = ""
    #: a memory tier (:class:`~ectier.tiers.arena.ArenaTier`): admits, pins, commits slots
    is_arena: bool = False
    #: on this node: takes puts and answers lookups without I/O (the remote tier does neither)
    local: bool = True

    @property
    @abc.abstractmethod
    def capacity_bytes(self) -> int:
        """The tier's byte budget."""

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int:
        """Bytes the tier's entries (and reservations) take from the budget."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Entries the tier holds."""

    @abc.abstractmethod
    def fits(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` could ever fit (within the whole budget)."""

    @abc.abstractmethod
    def holds(self, digest: bytes, version: int) -> bool:
        """Whether the tier holds ``version`` of ``digest`` (visible, no I/O)."""

    @abc.abstractmethod
    def stored_version(self, digest: bytes) -> int | None:
        """The version of ``digest`` the tier holds (visible), or ``None``."""

    @abc.abstractmethod
    def delete(self, digest: bytes) -> bool:
        """Remove ``digest``'s copy; True if something was removed (or freed) now."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """Occupancy facts for ``stats()``: capacity_bytes, used_bytes, entries and the tier's own."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free the tier's memory / close its files. Idempotent."""
