"""Eviction policies: they only pick victims. Pure Python.

A policy tracks ``key -> nbytes`` for the entries of one tier and, asked to free ``need_bytes``,
names victims among the entries that are not protected (pinned, in flight), **all or nothing**:
either a list whose sizes add up to at least ``need_bytes`` or ``None`` — never a partial
eviction that frees too little. Keys are opaque hashables (the cache passes 32-byte digests).

Policies: :class:`LRUPolicy` (recency only) and :class:`GDSFPolicy` (Greedy-Dual-Size-Frequency:
cost-aware, keeps entries whose recomputation saves the most seconds per byte). :func:`make_policy`
builds one from its config name (``"lru"`` | ``"gdsf"``).
"""

from __future__ import annotations

import abc
import heapq
import itertools
from collections import OrderedDict
from typing import Callable, Hashable, Iterable, Iterator

__all__ = ["EvictionPolicy", "LRUPolicy", "GDSFPolicy", "POLICY_NAMES", "make_policy"]

#: Names accepted by :func:`make_policy` (and by the ``host.policy`` / ``nvme.policy`` config fields).
POLICY_NAMES = ("lru", "gdsf")


class EvictionPolicy(abc.ABC):
    """Interface of every policy. Not thread-safe: the owning cache holds its lock around calls."""

    @abc.abstractmethod
    def add(self, key: Hashable, nbytes: int, cost: float | None = None) -> None:
        """Track a newly committed entry of ``nbytes`` bytes (most recently used).

        ``cost`` is what a miss on ``key`` costs, in seconds (the encoder time to recompute it);
        ``None`` means unknown (the policy's default). Cost-blind policies ignore it.

        Raises:
            ValueError: ``nbytes < 0`` or a negative / non-finite ``cost``.
        """

    def add_many(self, items: Iterable[tuple[Hashable, int]]) -> None:
        """:meth:`add` of each ``(key, nbytes)`` in order (the first ends least recently used),
        with the default cost (opening a store adopts its records so, in one call).

        Raises:
            ValueError: some ``nbytes < 0`` (the items before it are added).
        """
        for key, nbytes in items:
            self.add(key, nbytes)

    def replace(self, key: Hashable, nbytes: int, cost: float | None = None) -> None:
        """:meth:`remove` then :meth:`add` of ``key`` in one call: a newer version of a tracked
        entry was committed (every overwrite). Raises as :meth:`add` does (``key`` then untracked)."""
        self.remove(key)
        self.add(key, nbytes, cost)

    @abc.abstractmethod
    def touch(self, key: Hashable) -> None:
        """Record a hit on ``key`` (no-op for an unknown key)."""

    @abc.abstractmethod
    def remove(self, key: Hashable) -> None:
        """Stop tracking ``key`` (no-op for an unknown key)."""

    @abc.abstractmethod
    def victims(
        self, need_bytes: int, protected: Callable[[Hashable], bool] | None = None
    ) -> list[Hashable] | None:
        """Keys to evict, in eviction order, whose bytes sum to at least ``need_bytes``.

        Keys for which ``protected(key)`` is true are skipped. Returns ``[]`` when
        ``need_bytes <= 0`` and ``None`` when the unprotected entries cannot cover it. Does not
        remove anything: the caller removes what it actually evicts.
        """

    @abc.abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __iter__(self) -> Iterator[Hashable]:
        """Keys from the first to be evicted to the last."""


class LRUPolicy(EvictionPolicy):
    """Least recently used by bytes: victims are the oldest-touched entries.

    ``add``, ``touch`` and ``remove`` are O(1); ``victims`` walks from the least recently used end
    and stops as soon as enough bytes are covered (O(victims + protected entries skipped)).
    """

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, int] = OrderedDict()

    def add(self, key: Hashable, nbytes: int, cost: float | None = None) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes: must be >= 0, got {nbytes}")
        self._order[key] = nbytes
        self._order.move_to_end(key)

    #: an add of a tracked key already moves it to the most recently used end with its new size
    replace = add

    def add_many(self, items: Iterable[tuple[Hashable, int]]) -> None:
        items = list(items)
        if any(n < 0 for _, n in items):
            return super().add_many(items)  # raises at the first bad one, as add would
        order = self._order
        keys = {k for k, _ in items}
        if len(keys) == len(items) and order.keys().isdisjoint(keys):
            order.update(items)  # new distinct keys are appended in order: the usual case (at open)
        else:
            for key, nbytes in items:
                order[key] = nbytes
                order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victims(
        self, need_bytes: int, protected: Callable[[Hashable], bool] | None = None
    ) -> list[Hashable] | None:
        if need_bytes <= 0:
            return []
        chosen: list[Hashable] = []
        covered = 0
        for key, nbytes in self._order.items():
            if protected is not None and protected(key):
                continue
            chosen.append(key)
            covered += nbytes
            if covered >= need_bytes:
                return chosen
        return None

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._order))


class GDSFPolicy(EvictionPolicy):
    """Greedy-Dual-Size-Frequency (Cherkasova 1998): evict the lowest ``priority`` first, with

    ``priority(key) = clock + freq(key) * cost(key) / max(nbytes(key), 1)``

    - ``freq`` is 1 on :meth:`add` and grows by 1 on every :meth:`touch` (a hit);
    - ``cost`` is the seconds a miss costs (encoder recomputation), ``default_cost`` when unknown;
    - ``clock`` (aging) starts at 0 and is raised to the priority of the last victim chosen by
      :meth:`victims`, so entries that stopped being hit eventually fall below newly added ones.
      A priority is computed when an entry is added or touched, with the clock of that moment.

    Ties are broken by recency (least recently added/touched first), so with equal costs per
    byte and no hits GDSF evicts like LRU. ``victims`` still never removes anything, but it does
    advance ``clock``: the cache evicts every victim it is given. If it does not, the only effect
    is that entries added later age a little faster.

    ``add``/``touch`` are O(log n); ``remove`` is O(1) (lazy heap deletion; the stale items a
    ``touch`` or ``remove`` leaves are compacted away once they outnumber the live ones, so the
    heap stays under ~2x the entries however many hits come); ``victims`` is
    O((victims + protected skipped) log n).

    Args:
        default_cost: seconds for an entry added without a cost. The default, 1.0, makes every
            entry equally costly: GDSF then favours small, frequently hit entries (best item hit
            rate). Pass e.g. ``lambda nbytes: ...`` (seconds from bytes) for a size-derived default.

    Raises:
        ValueError: a negative or non-finite ``default_cost`` (at :meth:`add` for a callable).
    """

    def __init__(self, default_cost: float | Callable[[int], float] = 1.0) -> None:
        if not callable(default_cost):
            _check_cost(default_cost)
        self._default_cost = default_cost
        self.clock = 0.0
        # key -> [priority, seq, nbytes, cost, freq]; the heap holds (priority, seq, key)
        self._entries: dict[Hashable, list] = {}
        self._heap: list[tuple[float, int, Hashable]] = []
        self._seq = itertools.count()

    # -------------------------------------------------------------------------------- updates

    def add(self, key: Hashable, nbytes: int, cost: float | None = None) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes: must be >= 0, got {nbytes}")
        if cost is None:
            cost = self._default_cost(nbytes) if callable(self._default_cost) else self._default_cost
        _check_cost(cost)
        self._push(key, [0.0, 0, nbytes, float(cost), 1])

    def touch(self, key: Hashable) -> None:
        e = self._entries.get(key)
        if e is not None:
            e[4] += 1
            self._push(key, e)

    def remove(self, key: Hashable) -> None:
        self._entries.pop(key, None)  # its heap items turn stale
        self._compact_if_stale()

    def priority(self, key: Hashable) -> float:
        """Current priority of ``key`` (higher = kept longer). Raises ``KeyError`` if unknown."""
        return self._entries[key][0]

    def frequency(self, key: Hashable) -> int:
        """Hits + 1 of ``key`` since it was added. Raises ``KeyError`` if unknown."""
        return self._entries[key][4]

    def _push(self, key: Hashable, e: list) -> None:
        e[0] = self.clock + e[4] * e[3] / max(e[2], 1)
        e[1] = next(self._seq)
        self._entries[key] = e
        heapq.heappush(self._heap, (e[0], e[1], key))  # (a touch leaves the key's older item stale)
        self._compact_if_stale()

    def _compact_if_stale(self) -> None:
        """Drop the stale heap items once they outnumber the live ones (amortised O(1) per update):
        the heap stays under ~2x the entries however many hits come."""
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._compact()

    def _live(self, item: tuple[float, int, Hashable]) -> bool:
        e = self._entries.get(item[2])
        return e is not None and e[1] == item[1]

    def _compact(self) -> None:
        self._heap = [it for it in self._heap if self._live(it)]
        heapq.heapify(self._heap)

    # -------------------------------------------------------------------------------- queries

    def victims(
        self, need_bytes: int, protected: Callable[[Hashable], bool] | None = None
    ) -> list[Hashable] | None:
        if need_bytes <= 0:
            return []
        popped: list[tuple[float, int, Hashable]] = []
        chosen: list[Hashable] = []
        covered = 0
        last_priority = None
        try:
            while self._heap and covered < need_bytes:
                item = heapq.heappop(self._heap)
                if not self._live(item):
                    continue  # stale: dropped for good
                popped.append(item)
                key = item[2]
                if protected is not None and protected(key):
                    continue
                chosen.append(key)
                covered += self._entries[key][2]
                last_priority = item[0]
        finally:
            for item in popped:
                heapq.heappush(self._heap, item)
        if covered < need_bytes:
            return None
        if last_priority is not None:
            self.clock = max(self.clock, last_priority)
        return chosen

    @property
    def heap_items(self) -> int:
        """Items in the priority heap, the stale ones a ``touch`` or ``remove`` left included: the
        policy's memory is O(heap_items), which compaction keeps at most ``2 * len(self) + 64``
        after every update (a count, not bytes)."""
        return len(self._heap)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Hashable]:
        order = sorted((e[0], e[1], k) for k, e in self._entries.items()) if self._entries else []
        return iter([k for _, _, k in order])


def _check_cost(cost: object) -> None:
    if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0 <= cost < float("inf"):
        raise ValueError(f"cost: expected a finite number of seconds >= 0, got {cost!r}")


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by config name: ``"lru"`` -> :class:`LRUPolicy`, ``"gdsf"`` -> :class:`GDSFPolicy`.

    Raises:
        ValueError: an unknown name (the message lists :data:`POLICY_NAMES`).
    """
    if name == "lru":
        return LRUPolicy()
    if name == "gdsf":
        return GDSFPolicy()
    raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(POLICY_NAMES)}")
