"""The remote tier's logic on an in-memory store (``ectier.testing.MemoryBackend``): two caches on
one store stand for a producer and a consumer on two nodes. The real stores (Redis Cluster) are
tested in test_remote_redis.py; here: what moves when, and that a failure is a miss, never a
wrong tensor, an exception or a stall of the caller."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
import xxhash

from ectier import CacheConfig, testing
from ectier.config import GpuTierConfig
from ectier.entry import EntryMeta, entry_digest
from ectier.errors import ConfigError, EntryTooLargeError
from ectier.tiers.base import Tier
from ectier.tiers.remote.backend import RemoteError

KiB = 1024


def _cfg(tmp_path=None, **remote):
    d = {"namespace": "qwen", "host": {"capacity_bytes": "4MiB", "block_bytes": "64KiB", "pin_memory": False},
         "remote": {"timeout_s": 0.5, "backoff_s": 0.3, **remote}}
    if tmp_path is not None:
        d["nvme"] = {"path": str(tmp_path), "capacity_bytes": "64MiB"}
    return CacheConfig.from_dict(d)


def _t(seed, rows=64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 512, generator=g).to(torch.bfloat16)


def _same(a, b):
    return a is not None and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture
def nodes():
    be = testing.MemoryBackend()
    made = []

    def make(cfg=None, **kw):
        c = testing.make_cache(cfg or _cfg(), remote_backend=be, **kw)
        made.append(c)
        return c

    yield be, make
    for c in made:
        c.close()


def test_a_put_on_one_node_is_served_byte_exact_on_another(nodes):
    be, make = nodes
    producer, consumer = make(), make()
    t = _t(1)
    producer.put("img", t)
    assert testing.drain(producer)
    assert not consumer.contains("img")  # contains answers from local memory, no network I/O
    got = consumer.get("img")
    assert _same(got, t)
    assert testing.holds(consumer, "host", "img")  # now local: the next get is a host hit
    assert _same(consumer.get("img"), t)
    st = consumer.stats()
    assert st["tiers"]["remote"]["hits"] == 1 and st["tiers"]["host"]["hits"] == 1
    assert producer.stats()["tiers"]["remote"]["puts"] == 1
    testing.check_invariants(consumer)


def test_the_write_through_never_runs_on_the_callers_path(nodes):
    be, make = nodes
    producer = make(_cfg(timeout_s=5.0))
    release = threading.Event()
    entered = threading.Event()
    real_put = be.put

    def slow_put(key, data, *, deadline_s):
        entered.set()
        release.wait(10)
        real_put(key, data, deadline_s=deadline_s)

    be.put = slow_put
    producer.put("a", _t(2))  # returns although the store has not answered
    assert entered.wait(5) and not be.objects
    assert _same(producer.get("a"), _t(2))
    release.set()
    assert testing.drain(producer) and len(be.objects) == 1


def test_a_store_that_fails_is_a_miss_with_back_off_then_retried(nodes):
    be, make = nodes
    # a back-off of 1 s: the second get must land inside it (with 0.3 s a loaded machine could
    # pause this thread past it between the two gets, and the second one asked the store again)
    producer, consumer = make(), make(_cfg(backoff_s=1.0))
    producer.put("k", _t(3))
    testing.drain(producer)
    be.fail_with = RemoteError("connection refused (injected)")
    assert consumer.get("k") is None  # a miss, no exception
    calls = len(be.calls)
    assert consumer.get("k") is None and len(be.calls) == calls  # in back-off: no I/O at all
    st = consumer.stats()["tiers"]["remote"]
    assert st["errors"] == 1 and st["skipped_degraded"] >= 1 and st["degraded"]
    be.fail_with = None
    time.sleep(1.05)  # past remote.backoff_s
    assert _same(consumer.get("k"), _t(3)) and not consumer.stats()["tiers"]["remote"]["degraded"]


def test_a_store_that_hangs_costs_one_deadline_then_nothing(nodes):
    be, make = nodes
    # a back-off of 5 s: the second get lands inside it however late (with 0.3 s a pause of this
    # thread past it made the second get wait remote.timeout_s again, failing the 0.25 s bound)
    producer, consumer = make(), make(_cfg(backoff_s=5.0))
    producer.put("k", _t(4))
    testing.drain(producer)
    be.delay_s = 5.0  # past remote.timeout_s = 0.5
    t0 = time.monotonic()
    assert consumer.get("k") is None
    first = time.monotonic() - t0
    t0 = time.monotonic()
    assert consumer.get("k") is None
    assert first < 2.5 and time.monotonic() - t0 < 0.25  # one deadline, then skipped (back-off)
    assert consumer.stats()["tiers"]["remote"]["timeouts"] == 1


def test_bit_flips_foreign_entries_and_wrong_sizes_are_misses_never_wrong_tensors(nodes):
    be, make = nodes
    producer = make()
    for k, seed in (("a", 5), ("b", 6), ("c", 7)):
        producer.put(k, _t(seed))
    testing.drain(producer)
    remote = testing.tier(producer, "remote")
    key = {k: remote.key_of(entry_digest("qwen", k)) for k in "abc"}
    flipped = bytearray(be.objects[key["a"]])
    flipped[-3] ^= 0x10  # a bit flip in the payload
    be.objects[key["a"]] = bytes(flipped)
    be.objects[key["b"]] = be.objects[key["c"]]  # another entry's record under b's key
    be.objects[key["c"]] = be.objects[key["c"]][:-10]  # truncated
    consumer = make()
    assert consumer.get("a") is None and consumer.get("b") is None and consumer.get("c") is None
    st = consumer.stats()["tiers"]["remote"]
    assert st["checksum_failures"] == 3 and st["hits"] == 0
    assert len(consumer) == 0


def test_overwrite_and_delete_reach_the_other_node(nodes):
    be, make = nodes
    producer = make()
    producer.put("k", _t(7))
    producer.put("k", _t(8, rows=16))
    testing.drain(producer)
    assert _same(make().get("k"), _t(8, rows=16))
    producer.delete("k")
    assert make().get("k") is None and not be.objects


def test_prefetch_brings_a_remote_entry_into_the_host_tier(nodes):
    be, make = nodes
    producer, consumer = make(), make()
    producer.put("k", _t(9))
    testing.drain(producer)
    (h,) = consumer.prefetch(["k"])
    assert h.wait(5) and testing.holds(consumer, "host", "k")
    assert not consumer.prefetch(["nowhere"])[0].wait(5)


def test_a_hung_remote_fetch_never_holds_up_a_promotion_from_nvme(nodes, tmp_path, monkeypatch):
    """With one background slot (prefetch_threads=1), a prefetch whose remote fetch hangs used to
    take the pool's one thread: an NVMe hit's promotion waited behind it for the whole fetch."""
    be, make = nodes
    consumer = _one_slot_consumer(make, tmp_path, "far", _t(20))
    consumer.put("near", _t(21))
    testing.drain(consumer)
    assert testing.drop_copy(consumer, "host", "near") and testing.where(consumer, "near") >= {"nvme"}
    started = _signal_gets(be, monkeypatch)
    be.delay_s = 2.0  # every remote call from now on: 2 s (no timeout: remote.timeout_s=10)
    (far,) = consumer.prefetch(["far"])
    assert started.wait(5)  # the fetch has started
    t0 = time.monotonic()
    (near,) = consumer.prefetch(["near"])
    assert near.wait(1.5), "the NVMe promotion waited for the remote fetch"
    assert time.monotonic() - t0 < 1.5 and testing.holds(consumer, "host", "near")
    assert not far.done()  # still fetching: the promotion did not wait for it, nor it for the promotion
    assert far.wait(10) and _same(consumer.get("far"), _t(20))


def test_a_prefetch_that_turns_into_a_remote_fetch_leaves_the_slot_to_promotions(nodes, tmp_path, monkeypatch):
    """A key stored here when it was asked, gone here (still on the store) before its turn in the
    prefetch pool: its fetch moves to the fetch pool, and never holds the one background slot."""
    be, make = nodes
    consumer = _one_slot_consumer(make, tmp_path, "x", _t(30))
    for i, k in enumerate(("x", "y", "z")):
        consumer.put(k, _t(30 + i))
    testing.drain(consumer)
    for k in ("x", "y", "z"):
        assert testing.drop_copy(consumer, "host", k) and testing.where(consumer, k) >= {"nvme"}
    monkeypatch.setattr(be, "delete", lambda *a, **kw: None)  # the store keeps x (gone here only)
    started = _signal_gets(be, monkeypatch)
    be.delay_s = 2.0  # every remote call from now on: 2 s
    with consumer.background_read():  # the one slot is taken: both prefetches queue
        (y,) = consumer.prefetch(["y"])
        (x,) = consumer.prefetch(["x"])
        assert consumer.delete("x")
    assert y.wait(5) and started.wait(5)  # y promoted; x's remote fetch has started
    t0 = time.monotonic()
    (z,) = consumer.prefetch(["z"])
    assert z.wait(1.5), "the NVMe promotion waited for a remote fetch holding the slot"
    assert time.monotonic() - t0 < 1.5 and not x.done()
    assert x.wait(10) and _same(consumer.get("x"), _t(30))


def _one_slot_consumer(make, tmp_path, key, tensor):
    """A producer stores ``key`` remotely; returns a consumer with NVMe (write-through), one
    background slot (prefetch_threads=1) and a 10 s remote timeout (a 2 s delay never times out)."""
    producer = make()
    producer.put(key, tensor)
    testing.drain(producer)
    cfg = _cfg(tmp_path, timeout_s=10.0)
    return make(dataclasses.replace(cfg, prefetch_threads=1, nvme=dataclasses.replace(cfg.nvme, write_through=True)))


def _signal_gets(be, monkeypatch) -> threading.Event:
    """An event set when the fake store's ``get`` is first called."""
    started, get = threading.Event(), be.get

    def signalling_get(*a, **kw):
        started.set()
        return get(*a, **kw)

    monkeypatch.setattr(be, "get", signalling_get)
    return started


def test_acquire_leases_a_remote_entry_through_the_host_arena(nodes):
    be, make = nodes
    producer, consumer = make(), make()
    producer.put("k", _t(10))
    testing.drain(producer)
    lease = consumer.acquire("k")
    assert lease is not None and _same(consumer.load(lease).view(torch.bfloat16).view(64, 512), _t(10))
    consumer.release(lease)


def test_a_gpu_put_is_written_through_from_the_device_arena(nodes):
    be, make = nodes
    cfg = _cfg().replace(gpu=GpuTierConfig(capacity_bytes=8 << 20, block_bytes=1 << 20))
    producer = make(cfg, gpu_device="cpu")  # the GPU tier's arena in CPU memory
    producer.put("g", _t(11))
    assert testing.holds(producer, "gpu", "g")
    testing.drain(producer)
    assert _same(make().get("g"), _t(11))


def test_an_entry_too_large_for_the_remote_tier_is_not_written(nodes):
    be, make = nodes
    producer = make(_cfg(max_entry_bytes=256 * KiB))
    producer.put("big", _t(12, rows=512))  # 512 KiB
    testing.drain(producer)
    assert not be.objects and producer.stats()["tiers"]["remote"]["skipped_too_large"] == 1


def test_a_remote_hit_on_a_cache_with_nvme_lands_where_it_fits(nodes, tmp_path):
    be, make = nodes
    make().put("k", _t(13, rows=2048))  # 2 MiB
    producer = make()
    producer.put("k2", _t(14))
    testing.drain(producer)
    consumer = make(_cfg(tmp_path, max_entry_bytes=16 << 20).replace(
        host=CacheConfig.from_dict({"host": {"capacity_bytes": "1MiB", "pin_memory": False}}).host))
    assert _same(consumer.get("k"), _t(13, rows=2048))  # larger than the host: into NVMe
    assert testing.holds(consumer, "nvme", "k")
    testing.check_invariants(consumer)


def test_config_errors_name_the_remote_field():
    with pytest.raises(ConfigError, match="remote.addresses"):
        CacheConfig.from_dict({"remote": {"backend": "redis"}})
    with pytest.raises(ConfigError, match="remote.backend"):
        CacheConfig.from_dict({"remote": {"backend": "memcached", "addresses": "h:1"}})
    with pytest.raises(ConfigError, match="remote.addresses"):
        CacheConfig.from_dict({"remote": {"backend": "redis", "addresses": "nohost"}})


@pytest.mark.parametrize("bad", [-1, 0, 0.0, "x", True, float("inf")])
def test_remote_timeout_s_has_one_message_for_every_bad_value(bad):
    # before: -1 said "expected ... >= 0", then 0 was refused with "must be > 0"
    with pytest.raises(ConfigError, match=r"^remote.timeout_s: expected a finite number of seconds > 0, got "):
        CacheConfig.from_dict({"remote": {"backend": "redis", "addresses": "h:1", "timeout_s": bad}})


def test_the_remote_tier_is_a_tier_that_holds_nothing_locally(nodes):
    be, make = nodes
    c = make()
    t = testing.tier(c, "remote")
    assert isinstance(t, Tier) and t.name == "remote" and not t.local
    assert t.holds(b"x" * 32, 1) is False and t.stored_version(b"x" * 32) is None
    assert {"capacity_bytes", "used_bytes", "entries", "backend", "degraded"} <= set(t.describe())
    assert t.fits(1024) and not t.fits(t.capacity_bytes + 1)


def test_addresses_with_spaces_and_a_trailing_comma_are_read_as_the_user_meant():
    cfg = CacheConfig.from_dict({"remote": {"backend": "redis", "addresses": " 10.0.0.1:7000, 10.0.0.2:7001,"}})
    assert cfg.remote.address_list == [("10.0.0.1", 7000), ("10.0.0.2", 7001)]
    with pytest.raises(ConfigError, match="remote.addresses: required"):
        CacheConfig.from_dict({"remote": {"backend": "redis", "addresses": " , "}})
    with pytest.raises(ConfigError) as info:  # an unknown backend is one error, not two
        CacheConfig.from_dict({"remote": {"backend": "memcached"}})
    assert "remote.backend" in str(info.value) and "remote.addresses" not in str(info.value)


def test_object_keys_carry_the_prefix_once(nodes):
    be, make = nodes
    c = make(_cfg(prefix="site-a"))
    key = testing.tier(c, "remote").key_of(entry_digest("qwen", "k"))
    assert "site-a" not in key and key == entry_digest("qwen", "k").hex()


class _CountingKnown(testing.MemoryBackend):
    """The in-memory store, noting for each record put whether its checksum came known."""

    def __init__(self) -> None:
        super().__init__()
        self.known: list[bool] = []

    def put_record(self, key, header, payload, *, deadline_s, checksum_known=False):
        self.known.append(checksum_known)
        super().put_record(key, header, payload, deadline_s=deadline_s)


def _nvme_cfg(tmp_path, **nvme):
    cfg = _cfg(tmp_path)
    return cfg.replace(nvme=dataclasses.replace(cfg.nvme, **nvme))


@pytest.mark.parametrize("case, known", [
    ("straight to nvme", True),  # too large for the host: its NVMe record read back, checked
    ("host, nvme write-through", True),  # the host slot's bytes; the NVMe record of that version
    ("nvme zstd", False),  # the record's checksum is of the compressed bytes, not these
    ("host only", False),
])
def test_a_write_through_reuses_the_nvme_records_checksum_only_where_it_is_that_of_the_bytes(tmp_path, case, known):
    be = _CountingKnown()
    cfg = {"straight to nvme": _nvme_cfg(tmp_path), "host, nvme write-through": _nvme_cfg(tmp_path, write_through=True),
           "nvme zstd": _nvme_cfg(tmp_path, codec="zstd"), "host only": _cfg()}[case]
    rows = 5120 if "nvme" in case and "host" not in case else 1024  # 5 MiB: past the 4 MiB host
    t = _t(21, rows=rows)
    producer = testing.make_cache(cfg, remote_backend=be)
    consumer = testing.make_cache(_cfg(), remote_backend=be)
    try:
        producer.put("k", t)
        assert testing.drain(producer)
        assert be.known == [known]
        assert _same(consumer.get("k"), t)  # the record's checksum holds, whoever computed it
        assert consumer.stats()["tiers"]["remote"]["checksum_failures"] == 0
    finally:
        producer.close()
        consumer.close()


def test_a_remote_object_whose_payload_does_not_match_its_known_checksum_is_a_miss(nodes):
    be, make = nodes
    producer, consumer = make(), make()
    tier = testing.tier(producer, "remote")
    data = _t(22).view(-1).view(torch.uint8)
    meta = EntryMeta("qwen", "k", "bfloat16", (64, 512), data.numel())
    digest = entry_digest("qwen", "k")
    right = xxhash.xxh3_64_intdigest(data.numpy())
    assert tier.write(meta, data, 1, digest, payload_checksum=right ^ 1)  # stored as given: a wrong one
    assert consumer.get("k") is None
    assert consumer.stats()["tiers"]["remote"]["checksum_failures"] == 1
    assert tier.write(meta, data, 2, digest, payload_checksum=right)
    assert _same(consumer.get("k"), _t(22))


def test_too_large_for_every_tier_names_the_budgets_a_put_can_use_not_the_remote_tier(nodes, tmp_path):
    be, make = nodes
    for cache, budgets in ((make(), "host.capacity_bytes=4194304"),
                           (make(_nvme_cfg(tmp_path, capacity_bytes=4 << 20)),
                            "host.capacity_bytes=4194304, nvme.capacity_bytes=4194304")):
        with pytest.raises(EntryTooLargeError) as err:
            cache.put("big", _t(23, rows=5120))  # 5 MiB
        assert f"({budgets}); raise one of them" in str(err.value)
        assert "remote" not in str(err.value)  # written through from those tiers, never put into
        assert not be.objects


def test_an_object_the_backend_finds_damaged_is_a_counted_miss_without_back_off(nodes, monkeypatch):
    """A chunked store's own checks (Redis: a manifest that is not one, a chunk of the wrong size,
    a wrong xxh3) raise CorruptRecordError: a miss counted in checksum_failures, as a record that
    fails the tier's checks, and the store is not backed off (it answered)."""
    from ectier.errors import CorruptRecordError

    be, make = nodes
    producer, consumer = make(), make()
    producer.put("k", _t(40))
    testing.drain(producer)

    def damaged(key, *, deadline_s):
        raise CorruptRecordError("the chunks' xxh3 is not the manifest's")

    monkeypatch.setattr(be, "get", damaged)
    assert consumer.get("k") is None
    st = consumer.stats()["tiers"]["remote"]
    assert st["checksum_failures"] == 1 and st["backoffs"] == 0 and st["misses"] == 1


@pytest.mark.parametrize("addresses, says", [
    ("redis://127.0.0.1:6379", "without a scheme"),
    ("rediss://h:6379", "without a scheme"),
    ("10.0.0.1:7000 10.0.0.2:7001", "separate addresses with commas"),
    ("::1:6379", "IPv6 host goes in brackets"),
    ("[]:6379", "an IPv6 address is '[address]:port'"),
    ("127.0.0.1:99999", "outside 1..65535"),
    ("127.0.0.1 :6379", "no spaces inside an address"),
])
def test_an_address_a_client_could_never_reach_is_a_config_error_saying_why(addresses, says):
    with pytest.raises(ConfigError, match="remote.addresses") as info:
        CacheConfig.from_dict({"remote": {"backend": "redis", "addresses": addresses}})
    assert says in str(info.value)
    assert CacheConfig.from_dict({"remote": {"backend": "redis", "addresses": "[::1]:6379"}}).remote.address_list == [("::1", 6379)]


def test_a_tls_ca_path_needs_tls_and_a_file(tmp_path):
    base = {"backend": "redis", "addresses": "h:1"}
    with pytest.raises(ConfigError, match="remote.tls_ca_path: only used with remote.tls"):
        CacheConfig.from_dict({"remote": {**base, "tls_ca_path": str(tmp_path)}})
    with pytest.raises(ConfigError, match="remote.tls_ca_path: no file at"):
        CacheConfig.from_dict({"remote": {**base, "tls": True, "tls_ca_path": str(tmp_path / "ca.pem")}})
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    cfg = CacheConfig.from_dict({"remote": {**base, "tls": True, "tls_ca_path": str(tmp_path / "ca.pem")}})
    assert cfg.remote.tls_ca_path == str(tmp_path / "ca.pem")


def test_a_tls_ca_path_under_the_home_directory_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    cfg = CacheConfig.from_dict({"remote": {"backend": "redis", "addresses": "h:1", "tls": True, "tls_ca_path": "~/ca.pem"}})
    assert cfg.remote.tls_ca_path == str(tmp_path / "ca.pem")  # what the client is given


def test_a_tls_ca_path_may_be_a_path_object(tmp_path):
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    from ectier.config import RemoteTierConfig

    cfg = RemoteTierConfig(backend="redis", addresses="h:1", tls=True, tls_ca_path=tmp_path / "ca.pem")
    assert cfg.tls_ca_path == str(tmp_path / "ca.pem")


def test_wait_remote_returns_once_the_write_throughs_ran(nodes):
    be, make = nodes
    producer = make()
    gate = threading.Event()
    put = be.put

    def held(*a, **kw):
        assert gate.wait(10)
        return put(*a, **kw)

    be.put = held
    producer.put("k", _t(60))
    assert producer.wait_remote(0.2) is False  # the write is held at the store
    gate.set()
    assert producer.wait_remote(10) is True
    assert _same(make().get("k"), _t(60))
    local = testing.make_cache(CacheConfig.from_dict({"host": {"capacity_bytes": "4MiB", "pin_memory": False}}))
    assert local.wait_remote(0) is True  # no remote tier
    local.close()
    producer.close()
    with pytest.raises(Exception, match="closed"):
        producer.wait_remote()
