"""Eviction policies: they only pick victims. Pure Python.

A policy tracks ``key -> nbytes`` for the entries of one tier and, asked to free ``need_bytes``,
names victims among the entries that are not protected (pinned, in flight), **all or nothing**:
either a list whose sizes add up to at least ``need_bytes`` or ``None`` — never a partial
eviction that frees too little. Keys are opaque hashables (the cache passes 32-byte digests).
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from typing import Callable, Hashable, Iterator

__all__ = ["EvictionPolicy", "LRUPolicy"]


class EvictionPolicy(abc.ABC):
    """Interface of every policy. Not thread-safe: the owning cache holds its lock around calls."""

    @abc.abstractmethod
    def add(self, key: Hashable, nbytes: int) -> None:
        """Track a newly committed entry of ``nbytes`` bytes (most recently used)."""

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

    def add(self, key: Hashable, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes: must be >= 0, got {nbytes}")
        self._order[key] = nbytes
        self._order.move_to_end(key)

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
