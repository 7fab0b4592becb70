"""Typed counters of a cache and the ``stats()`` snapshot built from them.

One counter API: :meth:`Counters.count` (thread-safe, any thread, with or without the cache lock).
The names each scope keeps are fixed here, so a typo is a ``KeyError`` in tests, not a silent new
counter; ``stats()`` reports every one of them, zero or not.
"""

from __future__ import annotations

import threading
from collections import Counter
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
}


class Counters:
    """Event counters per scope (``"cache"``, ``"gpu"``, ``"host"``, ``"nvme"``)."""

    def __init__(self, scopes: Iterable[str] = COUNTER_NAMES) -> None:
        self._lock = threading.Lock()
        self._by_scope = {s: Counter() for s in scopes}

    def count(self, scope: str, **amounts: int) -> None:
        """Add ``amounts`` (counter name -> increment) to ``scope``.

        Raises:
            KeyError: an unknown scope or counter name.
        """
        names = COUNTER_NAMES[scope]
        for name in amounts:
            if name not in names:
                raise KeyError(f"unknown counter {scope}.{name}")
        with self._lock:
            self._by_scope[scope].update(amounts)

    def get(self, scope: str, name: str) -> int:
        with self._lock:
            return self._by_scope[scope][name]

    def snapshot(self, scope: str) -> dict[str, Any]:
        """Every counter of ``scope`` (zeros included), in the order of :data:`COUNTER_NAMES`."""
        with self._lock:
            c = self._by_scope[scope]
            return {name: c[name] for name in COUNTER_NAMES[scope]}
