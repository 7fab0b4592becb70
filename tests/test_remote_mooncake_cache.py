"""TieredCaches on one real Mooncake Store (``mooncake_master`` + a store node, started by the test
on loopback), through the config keys a user writes (``remote.backend: mooncake``): a producer's
put is served byte-exact by another cache from 0 B to 64 MiB (and by a process after the producer's
process exited: the store node holds the bytes), overwrite and delete reach it; a
damaged or foreign object is a counted miss; a master killed mid-run is misses and counted errors
within the deadline while the local tiers keep serving; a master down at start leaves the cache
open and degraded with one warning, and the tier reconnects by itself."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from ectier import CacheConfig, TieredCache, testing
from ectier.entry import entry_digest
from daemon_helpers import DaemonProcess, daemon_config, daemon_stats, remove_dir, short_tmpdir, wait_for, write_config
from mooncake_master import mooncake_store, mooncake_store_fn  # noqa: F401

MiB = 1 << 20
D = 20.0


def _cfg(store, host="160MiB", **remote):
    return CacheConfig.from_dict({
        "namespace": "qwen3-vl", "host": {"capacity_bytes": host, "pin_memory": False},
        "remote": store.remote_dict(**{"timeout_s": 1.0, "backoff_s": 0.5, **remote})})


def _t(seed: int, rows: int = 256) -> torch.Tensor:
    return torch.randn(rows, 8192, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _same(a, b) -> bool:
    return a is not None and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16),
                                                                                      b.view(torch.int16))


@pytest.fixture
def pair(mooncake_store, request):
    """A producer and a consumer on one prefix, with ``remote.timeout_s`` 1 s, or the seconds
    given by an indirect parametrization."""
    prefix = f"c-{request.node.name}".replace("[", "-").replace("]", "")
    timeout_s = getattr(request, "param", 1.0)
    made = [TieredCache(_cfg(mooncake_store, prefix=prefix, timeout_s=timeout_s)) for _ in range(2)]
    yield made
    for c in made:
        c.close()


# About bytes, not deadlines: a deadline no load on the machine reaches (a 64 MiB write-through
# took over 1 s under load, so the put was a counted timeout); the deadlines are
# test_a_master_killed_mid_run_*'s and test_remote_mooncake.py's.
@pytest.mark.parametrize("pair", [D], indirect=True)
@pytest.mark.parametrize("rows", [0, 1, 3, 1024, 4096])  # 0 B, 16 KiB, 48 KiB, 16 MiB, 64 MiB of bf16
def test_a_put_on_one_cache_is_served_byte_exact_by_another(pair, rows):
    producer, consumer = pair
    t = _t(rows, rows)
    producer.put("img", t)
    assert testing.drain(producer, timeout_s=2 * D)
    assert producer.stats()["tiers"]["remote"]["puts"] == 1
    got = consumer.get("img")
    assert _same(got, t)
    st = consumer.stats()["tiers"]["remote"]
    assert st["hits"] == 1 and st["hit_bytes"] == t.numel() * 2
    assert testing.holds(consumer, "host", "img")  # promoted into the host tier: served from there now


def test_overwrite_and_delete_reach_the_other_cache(pair, mooncake_store):
    producer, consumer = pair
    producer.put("k", _t(1, 64))
    assert testing.drain(producer)
    producer.put("k", _t(2, 512))  # larger: a new object under the same key
    assert testing.drain(producer)
    assert _same(consumer.get("k"), _t(2, 512))
    producer.delete("k")
    fresh = TieredCache(_cfg(mooncake_store, prefix=testing.tier(producer, "remote").config.prefix))
    try:
        assert fresh.get("k") is None
    finally:
        fresh.close()


def test_damaged_and_foreign_objects_are_counted_misses_never_wrong_tensors(pair):
    producer, consumer = pair
    for k, seed in (("a", 5), ("b", 6), ("c", 7)):
        producer.put(k, _t(seed, 16))
    assert testing.drain(producer)
    remote = testing.tier(producer, "remote")
    be = remote.backend
    key = {k: remote.key_of(entry_digest("qwen3-vl", k)) for k in "abc"}
    flipped = bytearray(be.get(key["a"], deadline_s=D))
    flipped[-3] ^= 0x10  # a bit flip in the payload
    be.put(key["a"], flipped, deadline_s=D)
    be.put(key["b"], bytes(be.get(key["c"], deadline_s=D)), deadline_s=D)  # another entry's record
    be.put(key["c"], bytes(be.get(key["c"], deadline_s=D))[:-10], deadline_s=D)  # truncated
    assert consumer.get("a") is None and consumer.get("b") is None and consumer.get("c") is None
    st = consumer.stats()["tiers"]["remote"]
    assert st["checksum_failures"] == 3 and st["hits"] == 0
    assert len(consumer) == 0


def test_a_master_killed_mid_run_is_misses_and_counted_errors_never_an_exception(mooncake_store_fn):
    store = mooncake_store_fn
    producer = TieredCache(_cfg(store))
    values = {f"k{i}": _t(100 + i, 64) for i in range(8)}
    for k, v in values.items():
        producer.put(k, v)
    assert testing.drain(producer)
    # a back-off of 5 s: 'degraded' is read after the gets, inside the window their first failure
    # opened however slow the machine (with 0.5 s a pause past it read False)
    consumer = TieredCache(_cfg(store, backoff_s=5.0))
    try:
        assert _same(consumer.get("k0"), values["k0"])  # reached while the master is up
        store.kill_master()
        t0 = time.monotonic()
        served = {k: consumer.get(k) for k in values}
        assert time.monotonic() - t0 < 8 * 1.0  # each call bounded by remote.timeout_s; then back-off
        assert all(g is None or _same(g, values[k]) for k, g in served.items())  # never a wrong tensor
        assert _same(served["k0"], values["k0"])  # the local copy keeps serving
        st = consumer.stats()["tiers"]["remote"]
        assert st["errors"] + st["timeouts"] >= 1 and st["degraded"] is True
        producer.put("local", _t(7, 8))  # the write-through fails in the background, the put does not
        assert _same(producer.get("local"), _t(7, 8))
        assert testing.drain(producer)
    finally:
        consumer.close()
        producer.close()


def test_a_master_down_at_start_degrades_with_one_warning_and_reconnects_by_itself(mooncake_store_fn, caplog):
    store = mooncake_store_fn
    store.kill_master()
    caplog.set_level(logging.WARNING, logger="ectier")
    cache = TieredCache(_cfg(store))  # opens while the master is down
    other = None
    try:
        assert cache.get("x") is None
        for i in range(3):
            cache.put(f"p{i}", _t(i, 8))  # served locally; write-throughs fail or are skipped
            assert _same(cache.get(f"p{i}"), _t(i, 8))
        assert testing.drain(cache)
        st = cache.stats()["tiers"]["remote"]
        assert st["degraded"] is True and st["errors"] + st["timeouts"] >= 1
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "remote tier" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        store.start_master()
        t = _t(42, 32)
        end = time.monotonic() + 60
        while time.monotonic() < end:  # after the back-off the tier tries again, by itself
            cache.put("back", t)
            assert testing.drain(cache)
            if cache.stats()["tiers"]["remote"]["puts"] >= 1:
                break
            time.sleep(0.5)
        assert cache.stats()["tiers"]["remote"]["puts"] >= 1
        other = TieredCache(_cfg(store))
        assert _same(other.get("back"), t)
        assert cache.stats()["tiers"]["remote"]["degraded"] is False
    finally:
        cache.close()
        if other is not None:
            other.close()


_PRODUCER = r"""
import json, sys, torch
from ectier import CacheConfig, TieredCache, testing
cfg = CacheConfig.from_dict(json.loads(sys.argv[1]))
c = TieredCache(cfg)
for i in range(3):
    c.put(f"img{i}", torch.randn(512, 8192, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16))
assert testing.drain(c)
print(c.stats()["tiers"]["remote"]["puts"])
c.close()
"""


def test_entries_of_a_producer_process_that_exited_are_served_to_another(mooncake_store):
    import json
    import subprocess
    import sys

    cfg = {"namespace": "qwen3-vl", "host": {"capacity_bytes": "64MiB", "pin_memory": False},
           "remote": mooncake_store.remote_dict(prefix="xproc", timeout_s=5.0)}
    done = subprocess.run([sys.executable, "-c", _PRODUCER, json.dumps(cfg)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "3"
    consumer = TieredCache(CacheConfig.from_dict(cfg))  # the producer lent no memory: the store node holds them
    try:
        for i in range(3):
            want = torch.randn(512, 8192, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
            assert _same(consumer.get(f"img{i}"), want), i
        assert consumer.stats()["tiers"]["remote"]["hits"] == 3
    finally:
        consumer.close()


def test_a_daemon_stops_on_sigterm_within_its_bound_while_the_master_hangs(mooncake_store_fn):
    """Mooncake's own teardown of a client against a hung master takes ~10-16 s (its HTTP and RPC
    timeouts, the GIL held); the daemon's close skips it and exits within a few timeout_s."""
    store = mooncake_store_fn
    d = short_tmpdir()
    try:
        cfg = daemon_config(d, host_bytes=32 * MiB, nvme_bytes=64 * MiB)
        cfg["remote"] = store.remote_dict(timeout_s=1.0, backoff_s=0.5)
        proc = DaemonProcess(write_config(f"{d}/cfg.yaml", cfg), cfg["daemon"]["socket_path"], via="script")
        proc.start()
        try:
            wait_for(lambda: daemon_stats(proc.socket_path)["tiers"]["remote"]["connected"], timeout=30,
                     what="the remote tier connected")
            store.pause_master()
            start = time.monotonic()
            rc = proc.terminate(timeout=30)
            elapsed = time.monotonic() - start
        finally:
            store.resume_master()
            proc.stop()
        assert rc == 0, proc.log()
        assert elapsed < 6.0, proc.log()  # close: <= 3 x timeout_s; Mooncake's teardown: ~10-16 s
        assert "left open" in proc.log()
    finally:
        remove_dir(d)


def test_an_entry_larger_than_the_stores_room_is_a_counted_refusal_not_a_back_off():
    """Mooncake answers NO_AVAILABLE_HANDLE to an object no segment has room for: the store is up,
    so the write-through is counted in errors and the tier backs nothing off (it used to go
    degraded for remote.backoff_s: every remote read of the node was a miss meanwhile)."""
    from mooncake_master import running_store

    with running_store("16MB") as store:
        producer, writer = (TieredCache(_cfg(store, prefix="room", timeout_s=D, backoff_s=60.0)) for _ in range(2))
        try:
            small = _t(1, 8)
            producer.put("small", small)
            assert testing.drain(producer)
            writer.put("big", _t(2, 1536))  # 24 MiB: more than the store node's 16 MB segment
            assert testing.drain(writer)
            st = writer.stats()["tiers"]["remote"]
            assert (st["puts"], st["errors"], st["backoffs"], st["degraded"]) == (0, 1, 0, False)
            got = writer.get("small")  # asked of the store at once, no back-off (the store may have
            if got is not None:        # evicted it while it looked for room for the big one)
                assert _same(got, small)
            after = writer.stats()["tiers"]["remote"]
            assert after["skipped_degraded"] == 0 and after["hits"] + after["misses"] == 1, after
        finally:
            producer.close()
            writer.close()
