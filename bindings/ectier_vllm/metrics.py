"""The connector's statistics in vLLM's EC-connector stats and Prometheus plumbing.

Flow in vLLM 0.33: the scheduler-side connector's ``get_ec_connector_stats()`` (and, with the V2
model runner, the worker-side one's) is attached to ``SchedulerStats.ec_connector_stats`` as the
``data`` dict; the logger process rebuilds an :class:`ECTierConnectorStats` through
``ECTierConnector.build_ec_connector_stats(data)`` for the periodic log line, and
``ECTierConnector.build_prom_metrics(...)`` creates :class:`ECTierPromMetrics`, whose ``observe``
turns the same dict into Prometheus counters and a histogram.

Worker counters travel to the scheduler inside the worker metadata (the V1 model runner does not
forward worker stats by itself), so the worker-side connector reports ``None`` and nothing is
counted twice. vLLM sums the metadata of all workers of an engine: only the lead worker
(:mod:`ectier_vllm.ranks`) counts loads and saves, and the scheduler counts ``load_failures`` once
per failed item, so tensor parallelism multiplies nothing. A pure producer on the V1 model runner
delivers no worker metadata at all; its scheduler counts ``saves``/``save_bytes``/``save_failures``
from what it sees in the store (:mod:`ectier_vllm.confirm`).

The ``data`` keys (all counts since the last report):

==================  =================================================================
lookups             items a consumer's scheduler asked ectier about (``has_cache_item``, after a
                    local encoder-cache miss): once per (request, item), however often vLLM asks
                    while it cannot place the request yet (no KV room, budget); again only if vLLM
                    needs the item anew after allocating it (e.g. a preempted request). A pure
                    ``ec_producer`` never loads: it counts no lookups (nor misses)
hits                of those, items found and pinned in ectier (no encoder run); each hit is
                    normally one ``loads`` (or a ``load_failures``) once vLLM places the request
misses              of those, items not in ectier (the encoder runs)
deferrals           steps a request waited for a promotion (``ensure_cache_available``)
recompute_chosen    stored items answered as a miss because loading them would take longer than
                    re-encoding them (:mod:`ectier_vllm.recompute`)
rejected            stored items refused: wrong shape/dtype for the request, failed checksum,
                    vanished between index and read, or promotion timed out (re-encoded)
loads               items placed in the (lead) worker's ``encoder_cache``
load_failures       items some worker could not load (their requests fail, retryable)
load_bytes          bytes placed in ``encoder_cache``
load_seconds        list: seconds per load (store read + device copy)
saves               items the producer stored
save_failures       items the producer could not store (logged; not shared)
save_bytes          bytes stored by the producer
==================  =================================================================
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
    PromMetric,
    PromMetricT,
)

COUNTERS = (
    "lookups",
    "hits",
    "misses",
    "deferrals",
    "rejected",
    "recompute_chosen",
    "loads",
    "load_failures",
    "load_bytes",
    "saves",
    "save_failures",
    "save_bytes",
)
MAX_SAMPLES = 10_000  # load_seconds kept per interval


def merge_stats_data(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Sum the counters of two ``data`` dicts and concatenate their ``load_seconds``."""
    out: dict[str, Any] = {}
    for key in set(a) | set(b):
        if key == "load_seconds":
            out[key] = (list(a.get(key, [])) + list(b.get(key, [])))[-MAX_SAMPLES:]
        else:
            out[key] = a.get(key, 0) + b.get(key, 0)
    return out


class ECTierConnectorStats(ECConnectorStats):
    """:class:`ECConnectorStats` over the ``data`` dict described in this module's docstring."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: ECConnectorStats) -> "ECTierConnectorStats":
        return ECTierConnectorStats(data=merge_stats_data(self.data, other.data))

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        times = d.get("load_seconds", [])
        lookups = d.get("lookups", 0)
        out: dict[str, int | float] = {k: d.get(k, 0) for k in COUNTERS}
        out["hit_rate"] = round(d.get("hits", 0) / lookups, 4) if lookups else 0.0
        out["avg_load_ms"] = round(1000 * sum(times) / len(times), 3) if times else 0.0
        out["max_load_ms"] = round(1000 * max(times), 3) if times else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in COUNTERS) and not self.data.get("load_seconds")


#: Prometheus names (vLLM prefixes its own with ``vllm:``; so do we) → (data key, help text).
PROM_COUNTERS = {
    "vllm:ectier_lookups": ("lookups", "Consumer EC lookups after a local encoder-cache miss, once per request and item"),
    "vllm:ectier_hits": ("hits", "EC lookups served from ectier (encoder not run), once per request and item"),
    "vllm:ectier_misses": ("misses", "EC lookups not in ectier (encoder runs), once per request and item"),
    "vllm:ectier_deferrals": ("deferrals", "Scheduler steps a request waited for an ectier promotion"),
    "vllm:ectier_rejected": ("rejected", "Stored items refused (shape/dtype mismatch, checksum, vanished, timeout)"),
    "vllm:ectier_recompute_chosen": ("recompute_chosen", "Stored items re-encoded because loading them would be slower"),
    "vllm:ectier_loads": ("loads", "Encoder outputs loaded into the worker's encoder cache"),
    "vllm:ectier_load_failures": ("load_failures", "Worker loads that failed (request failed, retryable)"),
    "vllm:ectier_load_bytes": ("load_bytes", "Bytes loaded into the worker's encoder cache"),
    "vllm:ectier_saves": ("saves", "Encoder outputs stored by the producer"),
    "vllm:ectier_save_failures": ("save_failures", "Producer stores that failed"),
    "vllm:ectier_save_bytes": ("save_bytes", "Bytes stored by the producer"),
}
PROM_LOAD_SECONDS = "vllm:ectier_load_seconds"
LOAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ECTierPromMetrics(ECConnectorPromMetrics):
    """Per-engine Prometheus counters (``vllm:ectier_*_total``) and a load-time histogram."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, (key, doc) in PROM_COUNTERS.items():
            metric = self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            self._counters[key] = {i: metric.labels(*v) for i, v in per_engine_labelvalues.items()}
        hist = self._histogram_cls(
            name=PROM_LOAD_SECONDS,
            documentation="Seconds per ectier load into the worker's encoder cache",
            buckets=LOAD_BUCKETS,
            labelnames=labelnames,
        )
        self._load_seconds = {i: hist.labels(*v) for i, v in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                per_engine[engine_idx].inc(value)
        for seconds in transfer_stats_data.get("load_seconds", ()):
            self._load_seconds[engine_idx].observe(seconds)


__all__ = [
    "COUNTERS",
    "ECTierConnectorStats",
    "ECTierPromMetrics",
    "merge_stats_data",
]
