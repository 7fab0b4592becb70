"""Two TieredCaches on one real Redis Cluster (started by the test on loopback): a producer's put
is served byte-exact by the other cache, through the config keys a user writes (``remote.*``);
a node killed mid-run makes its keys misses and the caches keep serving, never an exception."""

from __future__ import annotations

import time

import torch

from ectier import CacheConfig, TieredCache, testing
from redis_cluster import redis_cluster_fn, redis_single_fn  # noqa: F401


def _cfg(servers, **remote):
    return CacheConfig.from_dict({
        "namespace": "qwen3-vl", "host": {"capacity_bytes": "32MiB", "pin_memory": False},
        "remote": {"backend": "redis", "addresses": servers.addresses, "timeout_s": 0.5, "backoff_s": 0.5,
                   **remote}})


def _t(seed: int, rows: int = 1024) -> torch.Tensor:
    return torch.randn(rows, 2048, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _same(a, b) -> bool:
    return a is not None and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_an_entry_put_on_one_cache_is_served_by_another_through_the_cluster(redis_cluster_fn):
    # deadlines far above a 4 MiB transfer on a loaded machine: this test is about the bytes
    producer, consumer = (TieredCache(_cfg(redis_cluster_fn, timeout_s=20.0)),
                          TieredCache(_cfg(redis_cluster_fn, timeout_s=20.0)))
    try:
        values = {f"img{i}": _t(i) for i in range(6)}  # 4 MiB each: chunks across nodes
        for k, v in values.items():
            producer.put(k, v)
        assert testing.drain(producer)
        assert producer.stats()["tiers"]["remote"]["puts"] == 6
        for k, v in values.items():
            assert _same(consumer.get(k), v), k
        assert consumer.stats()["tiers"]["remote"]["hits"] == 6
        producer.delete("img0")
        with TieredCache(_cfg(redis_cluster_fn, timeout_s=20.0)) as third:
            assert third.get("img0") is None
    finally:
        producer.close()
        consumer.close()


def test_a_node_killed_mid_run_is_misses_and_counted_errors_never_an_exception(redis_cluster_fn):
    producer = TieredCache(_cfg(redis_cluster_fn))
    values = {f"k{i}": _t(100 + i, rows=64) for i in range(12)}
    for k, v in values.items():
        producer.put(k, v)
    assert testing.drain(producer)
    producer.close()
    redis_cluster_fn.kill(redis_cluster_fn.nodes[0])
    consumer = TieredCache(_cfg(redis_cluster_fn))
    try:
        t0 = time.monotonic()
        served = {k: consumer.get(k) for k in values}  # some on the dead node: misses
        assert time.monotonic() - t0 < 30
        assert all(g is None or _same(g, values[k]) for k, g in served.items())  # never a wrong tensor
        st = consumer.stats()["tiers"]["remote"]
        assert st["errors"] + st["timeouts"] + st["skipped_degraded"] >= 1
        consumer.put("local", _t(7, rows=8))  # the local tiers keep working
        assert _same(consumer.get("local"), _t(7, rows=8))
    finally:
        consumer.close()


def test_one_dead_node_backs_off_only_that_node_the_others_keep_serving(redis_cluster_fn):
    """One of three masters killed: the entries whose manifest and chunk are on live nodes are
    still written and read; no tier-wide back-off (backoff_s is long: the old tier-wide back-off
    skipped nearly every call after the first failure)."""
    servers = redis_cluster_fn
    servers.kill(servers.nodes[0])
    producer, consumer = TieredCache(_cfg(servers, backoff_s=30)), TieredCache(_cfg(servers, backoff_s=30))
    try:
        values = {f"img{i}": _t(200 + i, rows=16) for i in range(60)}  # 64 KiB: manifest + 1 chunk each
        for k, v in values.items():
            producer.put(k, v)
            assert testing.drain(producer)  # one at a time: each write-through meets the dead node or not
        sp = producer.stats()["tiers"]["remote"]
        stored = len(servers.all_keys("ectier:m:*", live_only=True))
        # parts on 2 of 3 nodes: about (2/3)**2 of the puts land wholly on live nodes (~27 of 60)
        assert sp["puts"] == stored and stored >= 15, sp
        assert sp["backoffs"] == 0 and sp["skipped_degraded"] == 0, sp
        assert sp["skipped_node_down"] >= 1, sp  # the dead node's calls fail at once, counted
        served = {k: consumer.get(k) for k in values}
        assert all(g is None or _same(g, values[k]) for k, g in served.items())
        sc = consumer.stats()["tiers"]["remote"]
        assert sc["hits"] == stored and sc["skipped_degraded"] == 0, sc  # every stored entry is served
    finally:
        producer.close()
        consumer.close()


def test_a_write_refused_for_memory_leaves_reads_going(redis_single_fn):
    """maxmemory with noeviction: the server refuses a write (OOM) but answers; that write is an
    error, counted, and no back-off: the entries the store holds are still served."""
    raw = redis_single_fn.raw()
    try:
        with TieredCache(_cfg(redis_single_fn, timeout_s=5.0)) as producer:
            small = _t(50, rows=16)  # 64 KiB
            producer.put("small", small)
            assert testing.drain(producer)
            raw.config_set("maxmemory-policy", "noeviction")
            raw.config_set("maxmemory", int(raw.info("memory")["used_memory"]) + 256 * 1024)
            producer.put("big", _t(51, rows=2048))  # 8 MiB: refused
            assert testing.drain(producer)
            st = producer.stats()["tiers"]["remote"]
            assert st["errors"] >= 1 and st["backoffs"] == 0
            with TieredCache(_cfg(redis_single_fn, timeout_s=5.0)) as consumer:
                assert _same(consumer.get("small"), small)
                assert consumer.get("big") is None
    finally:
        raw.config_set("maxmemory", 0)
        raw.close()


def test_a_key_of_another_type_under_the_prefix_is_one_miss_not_a_back_off(redis_single_fn):
    """Another tool writing a list where an entry's manifest would be: Redis answers WRONGTYPE.
    That used to count as the store failing: the whole tier backed off (every key a miss for
    ``remote.backoff_s``); now it is a miss of that key, counted in ``checksum_failures``."""
    from ectier.entry import entry_digest

    cfg = _cfg(redis_single_fn, timeout_s=5.0, backoff_s=30.0)
    producer, consumer = TieredCache(cfg), None
    try:
        want = _t(1, rows=64)
        producer.put("good", want)
        assert testing.drain(producer) and producer.wait_remote(10)
        raw = redis_single_fn.raw()
        try:
            raw.rpush(f"ectier:m:{entry_digest('qwen3-vl', 'bad').hex()}", b"x")
        finally:
            raw.close()
        consumer = TieredCache(cfg)
        assert consumer.get("bad") is None
        assert _same(consumer.get("good"), want)
        st = consumer.stats()["tiers"]["remote"]
        assert st["checksum_failures"] == 1 and st["backoffs"] == 0 and not st["degraded"], st
    finally:
        producer.close()
        if consumer is not None:
            consumer.close()
