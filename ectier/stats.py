"""Typed counters of a cache and the ``stats()`` snapshot built from them.

One counter API: :meth:`Counters.count` (thread-safe, any thread, with or without the cache lock).
The names each scope keeps are fixed here, so a typo is a ``KeyError`` in tests, not a silent new
counter; ``stats()`` reports every one of them, zero or not.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

__all__ = ["Counters", "COUNTER_NAMES"]

#: counter names per scope ("cache" and one per tier), as ``stats()`` reports them
COUNTER_NAMES: dict[str, tuple[str, ...]] = {
    "cache": ("hits", "misses", "copy_failures"),
    "gpu": ("hits", "hit_bytes", "puts", "put_bytes", "promotions", "promotion_failures", "evictions",
            "demotions", "drops", "skipped_too_large", "admission_timeouts", "copy_failures"),
    "host": ("hits", "hit_bytes", "puts", "put_bytes", "promotions", "evictions", "demotions",
             "drops", "skipped_too_large", "admission_timeouts"),
    "nvme": ("hits", "hit_bytes", "puts", "put_bytes", "evictions", "skipped_too_large",
             "write_failures", "read_failures"),
    "remote": ("hits", "hit_bytes", "misses", "puts", "put_bytes", "skipped_too_large", "skipped_backlog"),
}


class Counters:
    """Event counters per scope (``"cache"``, ``"gpu"``, ``"host"``, ``"nvme"``)."""

    def __init__(self, scopes: Iterable[str] = COUNTER_NAMES) -> None:
        self._lock = threading.Lock()
        self._by_scope = {s: dict.fromkeys(COUNTER_NAMES[s], 0) for s in scopes}

    def count(self, scope: str, **amounts: int) -> None:
        """Add ``amounts`` (counter name -> increment) to ``scope``.

        Raises:
            KeyError: an unknown scope or counter name (nothing is added then).
        """
        c = self._by_scope[scope]
        with self._lock:
            for name in amounts:
                if name not in c:
                    raise KeyError(f"unknown counter {scope}.{name}")
            for name, n in amounts.items():
                c[name] += n

    def count_put(self, scope: str, nbytes: int) -> None:
        """One put of ``nbytes`` committed into tier ``scope``."""
        with self._lock:
            t = self._by_scope[scope]
            t["puts"] += 1
            t["put_bytes"] += nbytes

    def count_hit(self, scope: str, nbytes: int) -> None:
        """One hit served by tier ``scope`` (``nbytes`` long): the tier's and the cache's counters."""
        with self._lock:
            t = self._by_scope[scope]
            t["hits"] += 1
            t["hit_bytes"] += nbytes
            self._by_scope["cache"]["hits"] += 1

    def get(self, scope: str, name: str) -> int:
        with self._lock:
            return self._by_scope[scope][name]

    def snapshot(self, scope: str) -> dict[str, Any]:
        """Every counter of ``scope`` (zeros included), in the order of :data:`COUNTER_NAMES`."""
        with self._lock:
            return dict(self._by_scope[scope])
