"""Typed counters of a cache and the ``stats()`` snapshot built from them.

One counter API: :meth:`Counters.count` (thread-safe, any thread, with or without the cache lock).
The names each scope keeps are fixed here, so a typo is a ``KeyError`` in tests, not a silent new
counter; ``stats()`` reports every one of them, zero or not. :class:`LatencyHistogram`: call
latencies per operation in fixed buckets (the remote tier's calls), as Prometheus histograms take them.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable

__all__ = ["Counters", "COUNTER_NAMES", "LatencyHistogram", "LATENCY_BUCKETS_S", "cache_stats"]

#: counter names per scope ("cache" and one per tier), as ``stats()`` reports them
COUNTER_NAMES: dict[str, tuple[str, ...]] = {
    "cache": ("hits", "misses", "copy_failures"),
    "gpu": ("hits", "hit_bytes", "puts", "put_bytes", "promotions", "promotion_failures", "evictions",
            "demotions", "drops", "skipped_too_large", "admission_timeouts", "copy_failures"),
    "host": ("hits", "hit_bytes", "puts", "put_bytes", "promotions", "evictions", "demotions",
             "drops", "skipped_too_large", "admission_timeouts", "clean_evictions", "dirty_evictions",
             "eviction_write_s", "write_behind_writes", "write_behind_bytes", "write_behind_failures"),
    "nvme": ("hits", "hit_bytes", "puts", "put_bytes", "evictions", "skipped_too_large",
             "write_failures", "read_failures", "disk_full_evictions"),
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


def cache_stats(namespace: str, counters: Counters, catalog: Any, stack: Iterable[Any]) -> dict[str, Any]:
    """``TieredCache.stats()``: the cache's counters and occupancy (``catalog``: its entries,
    every namespace's) and one dict per tier of ``stack``; the caller holds the cache's lock."""
    cache = counters.snapshot("cache")
    out: dict[str, Any] = {"namespace": namespace, "entries": len(catalog), "hits": cache["hits"],
                           "misses": cache["misses"], "in_flight": catalog.pending_count(),
                           "copy_failures": cache["copy_failures"], "tiers": {}}
    for t in stack:
        out["tiers"][t.name] = {**counters.snapshot(t.name), **t.describe()}
    return out


#: upper bounds (seconds) of the buckets of :class:`LatencyHistogram` (a last, unbounded bucket follows)
LATENCY_BUCKETS_S: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                                        2.5, 5.0, 10.0)


class LatencyHistogram:
    """Latencies (seconds) of calls per operation, counted in the buckets of :data:`LATENCY_BUCKETS_S`.

    Args:
        ops: the operation names observed (another name is a ``KeyError``).
    """

    def __init__(self, ops: Iterable[str]) -> None:
        self._lock = threading.Lock()
        n = len(LATENCY_BUCKETS_S) + 1
        self._counts = {op: [0] * n for op in ops}
        self._sums = dict.fromkeys(self._counts, 0.0)

    def observe(self, op: str, seconds: float) -> None:
        """Count one call of ``op`` that took ``seconds``.

        Raises:
            KeyError: an unknown operation.
        """
        counts = self._counts[op]
        i = next((i for i, le in enumerate(LATENCY_BUCKETS_S) if seconds <= le), len(LATENCY_BUCKETS_S))
        with self._lock:
            counts[i] += 1
            self._sums[op] += seconds

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """``{op: {"buckets": [[upper bound s, cumulative count], ...], "count": calls, "sum_s":
        seconds}}``, one bucket per bound of :data:`LATENCY_BUCKETS_S` (calls slower than the last
        bound are only in ``count``)."""
        out = {}
        with self._lock:
            for op, counts in self._counts.items():
                cum, buckets = 0, []
                for le, n in zip(LATENCY_BUCKETS_S, counts):
                    cum += n
                    buckets.append([le, cum])
                out[op] = {"buckets": buckets, "count": cum + counts[-1], "sum_s": self._sums[op]}
        return out
