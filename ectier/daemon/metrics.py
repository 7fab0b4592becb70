"""Prometheus metrics of the daemon, in encoder-cache terms (prometheus-client).

Exported (all read from ``TieredCache.stats()`` at scrape time, so they cost nothing between
scrapes):

==========================================  =========  ==============================================
metric                                      type       meaning
==========================================  =========  ==============================================
``ectier_lookups_total{result}``            counter    gets that hit / missed every tier
                                                       (a ``prefetch``'s pin: once a get takes it)
``ectier_tier_hits_total{tier}``            counter    reads a tier served (items): gets and
                                                       prefetches' reads, so the tiers add up to
                                                       more than the ``hit`` lookups
``ectier_tier_hit_bytes_total{tier}``       counter    bytes a tier served (as above)
``ectier_tier_puts_total{tier}``            counter    entries written into a tier
``ectier_tier_put_bytes_total{tier}``       counter    bytes written into a tier
``ectier_tier_evictions_total{tier}``       counter    entries evicted from a tier
``ectier_tier_misses_total{tier}``          counter    local misses a tier did not have either
                                                       (the remote tier)
``ectier_demotions_total``                  counter    host victims written down to NVMe
``ectier_promotions_total``                 counter    NVMe hits copied back up to host
``ectier_drops_total``                      counter    host victims lost (no room below)
``ectier_checksum_failures_total``          counter    NVMe records that failed a check (miss)
``ectier_tier_used_bytes{tier}``            gauge      bytes held by a tier
``ectier_tier_capacity_bytes{tier}``        gauge      budget of a tier
``ectier_tier_entries{tier}``               gauge      entries held by a tier
``ectier_clients``                          gauge      connected clients
``ectier_leases{kind}``                     gauge      open put / get leases
``ectier_leases_expired_total``             counter    leases reclaimed after ``daemon.lease_s``
``ectier_connections_closed_total{reason}`` counter    idle connections the daemon closed: ``idle``
                                                       (``daemon.idle_timeout_s``), ``evicted`` (room
                                                       for a new client at a connection cap)
``ectier_connections_refused_total``        counter    connections refused (user, caps)
``ectier_prefetches_total{result}``         counter    ``prefetch`` promotions: ``started``,
                                                       ``promoted`` (pinned for a get), ``failed``,
                                                       ``direct_read`` (into a scratch file),
                                                       ``scratch_refused`` (held scratch files
                                                       full: answered absent),
                                                       ``expired`` (pin not taken in ``lease_s``),
                                                       ``taken`` (by a get), ``yielded`` (pin ended
                                                       to make arena room for a put)
``ectier_prefetch_held_bytes``              gauge      arena bytes pinned by finished promotions
                                                       (whole ``host.block_bytes`` blocks)
``ectier_prefetch_held_scratch_bytes``      gauge      bytes of the scratch files finished direct
                                                       reads hold in ``daemon.shm_dir``
``ectier_view_pinned_bytes``                gauge      arena bytes clients' zero-copy views pin
``ectier_view_leases``                      gauge      process-held leases under views
``ectier_views_total{result}``              counter    view leases: ``granted``, ``refused`` (over
                                                       ``daemon.view_pin_bytes``: copied instead),
                                                       ``released``, ``released_dead`` (holder exited)
``ectier_remote_errors_total{kind}``        counter    remote calls that failed: ``error``,
                                                       ``timeout`` (past ``remote.timeout_s``),
                                                       ``checksum`` (an object failed its checks)
``ectier_remote_skipped_total{reason}``     counter    remote work not done: ``degraded`` (calls
                                                       in a back-off), ``backlog``, ``too_large``
                                                       (write-throughs), ``node_down`` (its node
                                                       known down)
``ectier_remote_backoffs_total``            counter    back-offs started after a failed call
``ectier_remote_degraded``                  gauge      1 while the remote tier is in a back-off
``ectier_remote_op_seconds{op}``            histogram  latency of remote calls (``put``, ``get``,
                                                       ``exists``, ``delete``), failed ones included
==========================================  =========  ==============================================

The ``ectier_remote_*`` families (and ``tier="remote"`` series) appear only with a remote tier
(``remote.backend``).
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["StatsCollector", "start_metrics_server"]


class StatsCollector:
    """A prometheus-client collector that turns ``stats()`` into metric families."""

    def __init__(self, stats_fn) -> None:
        self._stats = stats_fn  # () -> the stats dict, or None while there are none

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self._stats()
        if s is None:  # the daemon is still opening its tiers: no metrics yet
            return
        tiers = s.get("tiers", {})
        lookups = CounterMetricFamily("ectier_lookups", "Gets by result", labels=["result"])
        lookups.add_metric(["hit"], s.get("hits", 0))
        lookups.add_metric(["miss"], s.get("misses", 0))
        yield lookups

        def per_tier(name: str, doc: str, field: str, kind=CounterMetricFamily):
            fam = kind(name, doc, labels=["tier"])
            for tier, t in tiers.items():
                if field in t:
                    fam.add_metric([tier], t[field])
            return fam

        yield per_tier("ectier_tier_hits", "Reads a tier served: gets and prefetches (items)", "hits")
        yield per_tier("ectier_tier_hit_bytes", "Bytes a tier served: gets and prefetches", "hit_bytes")
        yield per_tier("ectier_tier_puts", "Entries written into a tier", "puts")
        yield per_tier("ectier_tier_put_bytes", "Bytes written into a tier", "put_bytes")
        yield per_tier("ectier_tier_evictions", "Entries evicted from a tier", "evictions")
        yield per_tier("ectier_tier_misses", "Local misses a tier did not have either", "misses")
        yield per_tier("ectier_tier_used_bytes", "Bytes held by a tier", "used_bytes", GaugeMetricFamily)
        yield per_tier("ectier_tier_capacity_bytes", "Byte budget of a tier", "capacity_bytes", GaugeMetricFamily)
        yield per_tier("ectier_tier_entries", "Entries held by a tier", "entries", GaugeMetricFamily)
        host = tiers.get("host", {})
        nvme = tiers.get("nvme", {})
        yield CounterMetricFamily("ectier_demotions", "Host victims written down to NVMe", value=host.get("demotions", 0))
        yield CounterMetricFamily("ectier_promotions", "NVMe hits copied back up to host", value=host.get("promotions", 0))
        yield CounterMetricFamily("ectier_drops", "Host victims lost for lack of room below", value=host.get("drops", 0))
        yield CounterMetricFamily("ectier_checksum_failures", "NVMe records that failed a check",
                                  value=nvme.get("checksum_failures", 0))
        if "remote" in tiers:
            yield from _remote_families(tiers["remote"])
        daemon = s.get("daemon")
        if daemon is not None:
            yield GaugeMetricFamily("ectier_clients", "Connected clients", value=len(daemon["clients"]))
            leases = GaugeMetricFamily("ectier_leases", "Open leases", labels=["kind"])
            for kind, n in daemon["leases"].items():
                leases.add_metric([kind], n)
            yield leases
            yield CounterMetricFamily("ectier_leases_expired", "Leases reclaimed after daemon.lease_s",
                                      value=daemon.get("leases_expired", 0))
            closed = CounterMetricFamily("ectier_connections_closed", "Idle connections the daemon closed",
                                         labels=["reason"])
            closed.add_metric(["idle"], daemon.get("idle_closed", 0))
            closed.add_metric(["evicted"], daemon.get("evicted", 0))
            yield closed
            yield CounterMetricFamily("ectier_connections_refused", "Connections refused (user, caps)",
                                      value=daemon.get("refused", 0))
            prefetch = daemon.get("prefetch") or {}
            fam = CounterMetricFamily("ectier_prefetches", "Promotions of the prefetch op", labels=["result"])
            for result, field in (("started", "started"), ("promoted", "promoted"), ("failed", "failed"),
                                  ("direct_read", "direct_reads"), ("scratch_refused", "scratch_refused"),
                                  ("expired", "expired"), ("taken", "taken"), ("yielded", "yielded")):
                fam.add_metric([result], prefetch.get(field, 0))
            yield fam
            yield GaugeMetricFamily("ectier_prefetch_held_bytes", "Arena bytes (whole blocks) pinned by finished promotions",
                                    value=prefetch.get("held_bytes", 0))
            yield GaugeMetricFamily("ectier_prefetch_held_scratch_bytes",
                                    "Bytes of scratch files in daemon.shm_dir held by finished direct reads",
                                    value=prefetch.get("held_scratch_bytes", 0))
            views = daemon.get("views") or {}
            yield GaugeMetricFamily("ectier_view_pinned_bytes", "Arena bytes (whole blocks) pinned under clients' zero-copy views",
                                    value=views.get("bytes", 0))
            yield GaugeMetricFamily("ectier_view_leases", "Process-held leases under views", value=views.get("leases", 0))
            fam = CounterMetricFamily("ectier_views", "View leases by result", labels=["result"])
            for result in ("granted", "refused", "released", "released_dead"):
                fam.add_metric([result], views.get(result, 0))
            yield fam


def _remote_families(r: dict[str, Any]) -> Iterable[Any]:
    """The remote tier's own families, from ``stats()["tiers"]["remote"]``."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    errors = CounterMetricFamily("ectier_remote_errors", "Remote calls that failed", labels=["kind"])
    for kind, field in (("error", "errors"), ("timeout", "timeouts"), ("checksum", "checksum_failures")):
        errors.add_metric([kind], r.get(field, 0))
    yield errors
    skipped = CounterMetricFamily("ectier_remote_skipped", "Remote work not done", labels=["reason"])
    for reason, field in (("degraded", "skipped_degraded"), ("backlog", "skipped_backlog"),
                          ("too_large", "skipped_too_large"), ("node_down", "skipped_node_down")):
        skipped.add_metric([reason], r.get(field, 0))
    yield skipped
    yield CounterMetricFamily("ectier_remote_backoffs", "Back-offs started after a failed remote call",
                              value=r.get("backoffs", 0))
    yield GaugeMetricFamily("ectier_remote_degraded", "1 while the remote tier is in a back-off",
                            value=1 if r.get("degraded") else 0)
    hist = HistogramMetricFamily("ectier_remote_op_seconds", "Latency of remote calls", labels=["op"])
    for op, h in (r.get("latency") or {}).items():
        buckets = [(repr(float(le)), n) for le, n in h["buckets"]] + [("+Inf", h["count"])]
        hist.add_metric([op], buckets, h["sum_s"])
    yield hist


def start_metrics_server(server, host: str, port: int):
    """Serve ``/metrics`` for ``server`` (a DaemonServer) on ``host:port``; returns the HTTP server
    (call ``.shutdown()`` to stop). Raises ImportError naming the ``prometheus-client`` package."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise ImportError("daemon.metrics_port needs the prometheus-client package") from exc
    registry = CollectorRegistry()
    registry.register(StatsCollector(lambda: server.stats() if server.cache is not None else None))
    httpd, _thread = start_http_server(port, addr=host, registry=registry)
    return httpd
