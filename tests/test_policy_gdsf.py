"""GDSFPolicy: victim order by priority, aging clock, all-or-nothing, protection, config plumbing."""

from __future__ import annotations

import pytest

from ectier.config import CacheConfig, HostTierConfig, NvmeTierConfig
from ectier.errors import ConfigError
from ectier.policy import EvictionPolicy, GDSFPolicy, LRUPolicy, make_policy


def test_is_an_eviction_policy_and_factory():
    assert isinstance(GDSFPolicy(), EvictionPolicy)
    assert isinstance(make_policy("gdsf"), GDSFPolicy) and isinstance(make_policy("lru"), LRUPolicy)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("fifo")


def test_victims_lowest_cost_per_byte_first():
    p = GDSFPolicy()
    p.add("big_cheap", 100, cost=1.0)     # 0.01 / byte
    p.add("small_dear", 10, cost=1.0)     # 0.1 / byte
    p.add("mid", 50, cost=2.0)            # 0.04 / byte
    assert list(p) == ["big_cheap", "mid", "small_dear"]
    assert p.victims(1) == ["big_cheap"]
    assert p.victims(101) == ["big_cheap", "mid"]


def test_frequency_raises_priority():
    p = GDSFPolicy()
    p.add("a", 10, cost=1.0)
    p.add("b", 10, cost=1.0)
    assert p.victims(1) == ["a"]          # equal priority: least recently added first
    p.touch("a")
    assert p.frequency("a") == 2
    assert p.victims(1) == ["b"]
    # the first victims() call aged the clock to a's priority 0.1; the touch re-prices a: 0.1 + 2 * 0.1
    assert p.clock == pytest.approx(0.1)
    assert p.priority("a") == pytest.approx(0.3)


def test_clock_ages_to_last_victim_priority():
    p = GDSFPolicy()
    p.add("a", 10, cost=1.0)   # 0.1
    p.add("b", 10, cost=3.0)   # 0.3
    assert p.victims(10) == ["a"]
    assert p.clock == pytest.approx(0.1)
    p.remove("a")
    p.add("c", 10, cost=1.0)   # 0.1 + 0.1 = 0.2, still below b
    assert p.priority("c") == pytest.approx(0.2)
    assert p.victims(10) == ["c"]
    p.remove("c")
    assert p.clock == pytest.approx(0.2)
    p.add("d", 10, cost=1.0)   # 0.3: ties with b, b is older
    p.add("e", 10, cost=1.0)
    assert p.victims(10) == ["b"]
    p.remove("b")
    # aging: an entry that stopped being hit falls below newer ones eventually
    p.add("x", 10, cost=1.0)
    assert list(p)[0] in ("d", "e")


def test_all_or_nothing_and_no_clock_change_on_failure():
    p = GDSFPolicy()
    p.add("a", 10, cost=1.0)
    p.add("b", 20, cost=1.0)
    assert p.victims(31) is None
    assert p.clock == 0.0
    assert sorted(p.victims(30)) == ["a", "b"]
    assert p.victims(0) == [] and p.victims(-3) == []
    assert GDSFPolicy().victims(1) is None


def test_protected_keys_skipped_and_not_counted():
    p = GDSFPolicy()
    p.add("a", 100, cost=0.1)
    p.add("b", 10, cost=1.0)
    p.add("c", 10, cost=2.0)
    assert p.victims(15, protected=lambda k: k == "a") == ["b", "c"]
    assert p.victims(20, protected=lambda k: k != "c") is None
    assert len(p) == 3 and all(k in p for k in "abc")  # victims removes nothing


def test_remove_readd_and_default_cost():
    p = GDSFPolicy(default_cost=lambda nbytes: nbytes * 2.0)
    p.add("a", 10)
    assert p.priority("a") == pytest.approx(2.0)
    p.remove("a")
    p.remove("a")
    assert "a" not in p and len(p) == 0
    for i in range(500):  # lazy deletions compact
        p.add(i, 1, cost=1.0)
        p.remove(i)
    assert p.heap_items < 200
    p.add("a", 10, cost=1.0)
    p.touch("a")
    p.add("a", 10, cost=1.0)  # re-add resets frequency
    assert p.frequency("a") == 1
    with pytest.raises(ValueError, match="cost"):
        p.add("z", 1, cost=-1.0)
    with pytest.raises(ValueError, match="nbytes"):
        p.add("z", -1)


def test_zero_byte_entry_and_lru_ignores_cost():
    p = GDSFPolicy()
    p.add("z", 0, cost=1.0)
    assert p.victims(0) == []
    lru = LRUPolicy()
    lru.add("a", 1, cost=5.0)
    lru.add("b", 1)
    assert lru.victims(1) == ["a"]


def test_config_policy_fields_validated():
    assert CacheConfig.from_dict({"host": {"policy": "gdsf"}, "nvme": {"policy": "gdsf"}}).host.policy == "gdsf"
    assert HostTierConfig().policy == "lru" and NvmeTierConfig().policy == "lru"
    with pytest.raises(ConfigError, match="host.policy"):
        HostTierConfig(policy="mru")
    with pytest.raises(ConfigError, match="nvme.policy"):
        NvmeTierConfig(policy=3)


def test_cache_gdsf_keeps_costly_entries(tmp_path):
    torch = pytest.importorskip("torch")
    from ectier.cache import TieredCache

    blk = 64 * 1024
    cfg = {"host": {"capacity_bytes": 4 * blk, "block_bytes": blk, "policy": "gdsf", "admit_wait_s": 0}}
    with TieredCache(cfg) as c:
        t = torch.zeros(blk // 2, dtype=torch.bfloat16)
        c.put("dear", t, cost_s=10.0)
        c.put("cheap1", t, cost_s=0.001)
        c.put("cheap2", t, cost_s=0.001)
        c.put("cheap3", t, cost_s=0.001)
        c.put("new", t, cost_s=1.0)  # evicts the cheapest, not the oldest ("dear")
        assert "dear" in c and "new" in c and "cheap1" not in c
        with pytest.raises(ValueError, match="cost_s"):
            c.put("bad", t, cost_s=float("nan"))


def test_memory_stays_bounded_under_hits_alone():
    """A warm cache whose entries all fit: only hits, no evictions or removals. Each touch used to
    leave a stale heap item that only a remove or a victims() pass dropped: ~130 bytes per hit,
    without bound (80 MiB per 600k hits)."""
    import tracemalloc

    p = GDSFPolicy()
    for i in range(8):
        p.add(f"k{i}", 1024)
    for n in range(2000):  # past the first compaction
        p.touch(f"k{n % 8}")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(40000):
            p.touch(f"k{n % 8}")
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, f"{grown} bytes kept by 40,000 hits on 8 entries"
    assert sorted(p) == sorted(f"k{i}" for i in range(8)) and p.victims(1024) == [list(p)[0]]
