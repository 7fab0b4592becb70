"""The daemon with a remote tier, end to end: real daemons (``ectier serve --config X.yaml`` with a
``remote:`` section) on a real store (``remote_stores.remote_store``: a 3-node Redis Cluster on
loopback, and any backend added there later).

A producer client puts through one daemon; a consumer daemon (another store directory, another
socket: another node as far as ectier can tell) serves the entry byte-exact through the remote
tier, also after it restarted. Entries that go straight to NVMe (larger than the host arena, or a
cache without a host tier) are written through too. The remote tier's hits, misses, bytes, errors
and latency are on the daemon's Prometheus page like the other tiers'.
"""

from __future__ import annotations

import subprocess
import urllib.request
from typing import Any

from daemon_helpers import (ECTIER_SCRIPT, MiB, DaemonProcess, assert_same, clean_env, daemon_process, daemon_stats,
                            make_tensor, wait_for)
from server_helpers import free_port
from remote_stores import remote_store  # noqa: F401

from ectier import CacheConfig, TieredCache, testing
from ectier.daemon.client import DaemonClient

SHAPE = (1024, 2048)  # 4 MiB of bfloat16: two chunks and a bit on the store


def remote_daemon(remote: dict[str, Any], *, host_bytes: int = 32 * MiB, metrics: bool = False):
    """A daemon (``ectier serve --config <dir>/cfg.yaml``'s code, forked: tests/daemon_helpers.py) with host, NVMe and ``remote`` (a
    ``remote:`` section) in a fresh directory; ``.dir``, ``.cfg``; stopped and removed after."""
    return daemon_process("cfg.yaml", host_bytes=host_bytes, nvme_bytes=128 * MiB,
                          edit=lambda cfg: cfg.update(remote=remote), **({"metrics_port": 0} if metrics else {}))


def remote_stats(proc: DaemonProcess) -> dict[str, Any]:
    return daemon_stats(proc.socket_path)["tiers"]["remote"]


def wait_written(proc: DaemonProcess, n: int) -> None:
    """Wait until ``proc`` wrote ``n`` entries through to the remote store (in the background)."""
    wait_for(lambda: remote_stats(proc)["puts"] >= n, timeout=30, what=f"{n} remote write-throughs")


def scrape(proc: DaemonProcess) -> dict[tuple[str, tuple], float]:
    """The daemon's ``/metrics`` page: ``{(sample name, sorted labels): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    m = daemon_stats(proc.socket_path)["daemon"]["metrics"]
    with urllib.request.urlopen(f"http://{m['host']}:{m['port']}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_a_put_through_one_daemon_is_served_by_another_and_after_its_restart(remote_store):
    remote = remote_store.section()
    values = {f"img{i}": make_tensor(i, "bfloat16", SHAPE) for i in range(6)}
    with remote_daemon(remote) as producer, remote_daemon(remote) as consumer:
        with DaemonClient(producer.socket_path, client_name="encoder") as c:
            for k, v in values.items():
                c.put(k, v)
        wait_written(producer, len(values))
        before = ["img0", "img1", "img2"]
        with DaemonClient(consumer.socket_path, client_name="pd") as c:
            for k in before:
                assert_same(c.get(k), values[k])
            assert c.get("never-put") is None
        st = remote_stats(consumer)
        assert (st["hits"], st["hit_bytes"], st["misses"]) == (3, 3 * 4 * MiB, 1)

        consumer.terminate()  # flushes its host entries to its NVMe; the other three it never had
        consumer.start()
        with DaemonClient(consumer.socket_path, client_name="pd") as c:
            for k, v in values.items():
                assert_same(c.get(k), v)
        st = remote_stats(consumer)
        assert st["hits"] == 3  # img3..img5, from the store; img0..img2 from its own NVMe
        assert st["errors"] + st["timeouts"] + st["checksum_failures"] == 0


def test_the_remote_tier_is_on_the_prometheus_page_like_the_other_tiers(remote_store):
    remote = remote_store.section()
    t = make_tensor(7, "bfloat16", SHAPE)
    with remote_daemon(remote, metrics=True) as producer, remote_daemon(remote, metrics=True) as consumer:
        with DaemonClient(producer.socket_path) as c:
            c.put("img", t)
        wait_written(producer, 1)
        with DaemonClient(consumer.socket_path) as c:
            assert_same(c.get("img"), t)
            assert c.get("absent") is None
        p, m = scrape(producer), scrape(consumer)
    remote = (("tier", "remote"),)
    assert p["ectier_tier_puts_total", remote] == 1
    assert p["ectier_tier_put_bytes_total", remote] == 4 * MiB
    assert p["ectier_remote_op_seconds_count", (("op", "put"),)] >= 1
    assert m["ectier_tier_hits_total", remote] == 1
    assert m["ectier_tier_hit_bytes_total", remote] == 4 * MiB
    assert m["ectier_tier_misses_total", remote] == 1
    assert m["ectier_remote_op_seconds_count", (("op", "get"),)] == 2  # the hit and the miss
    assert m["ectier_remote_op_seconds_bucket", (("le", "+Inf"), ("op", "get"))] == 2
    assert m["ectier_remote_op_seconds_sum", (("op", "get"),)] > 0
    assert m["ectier_remote_errors_total", (("kind", "error"),)] == 0
    assert m["ectier_remote_degraded", ()] == 0


def test_a_store_that_is_down_is_counted_errors_and_degraded_on_the_prometheus_page(remote_store):
    dead = remote_store.section(addresses=f"127.0.0.1:{free_port()}", timeout_s=0.5, backoff_s=60)
    with remote_daemon(dead, metrics=True) as d:
        with DaemonClient(d.socket_path) as c:
            assert c.get("a") is None  # a miss, not an error
            assert c.get("b") is None  # skipped: in back-off
            t = make_tensor(1, "uint8", (1000,))
            c.put("local", t)  # the local tiers keep serving
            assert_same(c.get("local"), t)
        m = scrape(d)
        shown = subprocess.run([ECTIER_SCRIPT, "stats", "--socket", d.socket_path], capture_output=True, text=True,
                               timeout=60, env=dict(clean_env(), COLUMNS="200"))
        startup = d.log()
    # before: `ectier stats` of a daemon with a remote tier died on a KeyError ('evictions')
    assert shown.returncode == 0, shown.stderr
    assert "remote" in shown.stdout and "errors" in shown.stdout
    table = {line.split("│")[1].strip(): line for line in shown.stdout.splitlines() if line.count("│") >= 3}
    assert "timeouts" in table and "degraded (back-off)" in table, shown.stdout  # docs/operations.md: watch them
    assert "yes" in table["degraded (back-off)"]
    assert "max entry 256.0 MiB" in table["used / capacity"]  # remote.max_entry_bytes, not the store's size
    assert f"remote {dead['backend']} at {dead['addresses']}" in startup  # the startup line names the store
    assert m["ectier_remote_errors_total", (("kind", "error"),)] + m[
        "ectier_remote_errors_total", (("kind", "timeout"),)] >= 1
    assert m["ectier_remote_backoffs_total", ()] >= 1
    assert m["ectier_remote_skipped_total", (("reason", "degraded"),)] >= 1
    assert m["ectier_remote_skipped_total", (("reason", "node_down"),)] == 0  # every reason is exported
    assert m["ectier_remote_degraded", ()] == 1


def test_a_put_larger_than_the_host_arena_is_written_through_from_nvme(remote_store):
    """Before: a put that went straight to NVMe (a scratch-file put through the daemon) was never
    written to the remote tier; the consumer missed it."""
    remote = remote_store.section()
    big = make_tensor(3, "bfloat16", (3072, 2048))  # 12 MiB > the producer's 8 MiB arena
    with remote_daemon(remote, host_bytes=8 * MiB) as producer, remote_daemon(remote) as consumer:
        with DaemonClient(producer.socket_path) as c:
            c.put("big", big)
        wait_written(producer, 1)
        with DaemonClient(consumer.socket_path) as c:
            assert_same(c.get("big"), big)
        assert remote_stats(consumer)["hits"] == 1


def test_a_host_less_cache_writes_its_nvme_puts_through(remote_store, tmp_path):
    """Before: with no host tier every put went to NVMe only; another node never found it."""
    remote = remote_store.section()
    producer = TieredCache(CacheConfig.from_dict({
        "namespace": "ns", "host": {"capacity_bytes": 0},
        "nvme": {"path": str(tmp_path / "p"), "capacity_bytes": "64MiB", "sync": False}, "remote": remote}))
    consumer = TieredCache(CacheConfig.from_dict({
        "namespace": "ns", "host": {"capacity_bytes": "16MiB", "pin_memory": False}, "remote": remote}))
    try:
        values = {f"k{i}": make_tensor(10 + i, "bfloat16", (512, 2048)) for i in range(3)}
        for k, v in values.items():
            producer.put(k, v)
        assert testing.drain(producer)
        assert producer.stats()["tiers"]["remote"]["puts"] == 3
        for k, v in values.items():
            assert_same(consumer.get(k), v)
        producer.put("k0", values["k1"])  # an overwrite is written through as the newer version
        assert testing.drain(producer)
        fresh = TieredCache(CacheConfig.from_dict({
            "namespace": "ns", "host": {"capacity_bytes": "16MiB", "pin_memory": False}, "remote": remote}))
        try:
            assert_same(fresh.get("k0"), values["k1"])
        finally:
            fresh.close()
    finally:
        producer.close()
        consumer.close()


def test_the_latency_histogram_counts_each_call_in_its_bucket_cumulatively():
    from ectier.stats import LATENCY_BUCKETS_S, LatencyHistogram

    h = LatencyHistogram(("get", "put"))
    for s in (0.0001, 0.003, 0.003, 0.7, 60.0):
        h.observe("get", s)
    snap = h.snapshot()
    got = dict((le, n) for le, n in snap["get"]["buckets"])
    assert [le for le, _ in snap["get"]["buckets"]] == list(LATENCY_BUCKETS_S)
    assert (got[0.0005], got[0.0025], got[0.005], got[0.5], got[1.0], got[10.0]) == (1, 1, 3, 3, 4, 4)
    assert snap["get"]["count"] == 5 and abs(snap["get"]["sum_s"] - 60.7061) < 1e-9
    assert snap["put"] == {"buckets": [[le, 0] for le in LATENCY_BUCKETS_S], "count": 0, "sum_s": 0.0}


def test_the_prefetch_op_fetches_a_remote_only_entry_in_the_background(remote_store):
    """Before: ``prefetch`` answered ``absent`` for every key the consumer daemon did not hold
    locally (it asked only ``contains``), so a vLLM consumer in daemon mode never used the remote
    tier."""
    remote = remote_store.section()
    t = make_tensor(5, "bfloat16", SHAPE)
    with remote_daemon(remote) as producer, remote_daemon(remote) as consumer:
        with DaemonClient(producer.socket_path) as c:
            c.put("img", t)
        wait_written(producer, 1)
        with DaemonClient(consumer.socket_path) as c:
            first = c.prefetch(["img", "never-put"])
            assert first[0] in ("promoting", "ready") and first[1] in ("promoting", "absent")
            wait_for(lambda: c.prefetch(["img"]) == ["ready"], timeout=20, what="the remote entry to be ready")
            wait_for(lambda: c.prefetch(["never-put"]) == ["absent"], timeout=20, what="a remote miss to be absent")
            assert_same(c.get("img"), t)
        s = daemon_stats(consumer.socket_path)
        assert s["tiers"]["remote"]["hits"] == 1  # fetched once, by the prefetch
        assert s["daemon"]["prefetch"]["taken"] == 1  # the get took the prefetch's pin: no I/O
