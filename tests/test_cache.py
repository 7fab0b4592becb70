"""Contract tests of TieredCache: API, dtypes/shapes, namespaces. CPU only; small budgets (64 KiB
blocks). Keys and bad input: test_cache_keys.py; overwrite and eviction across host -> NVMe:
test_cache_eviction.py."""

from __future__ import annotations

import pytest
import torch

from ectier import CacheConfig, HostTierConfig, InvalidKeyError, TieredCache

from conftest import (
    ALL_DTYPES,
    KiB,
    MiB,
    assert_same,
    check_quiescent,
    filled,
    host_holds,
    nvme_holds,
    random_tensor,
    raw_bytes,
)
from ectier import testing


SHAPES = [(), (7,), (3, 5, 4), (0, 8192), (2, 8192), (4, 0, 3)]


# ============================================================================ contract


def test_put_get_contains_delete_len_stats(make_cache):
    cache, _ = make_cache()
    a, b = random_tensor((4, 8192), torch.bfloat16, 1), random_tensor((3, 100), torch.float32, 2)
    assert len(cache) == 0
    assert not cache.contains("a") and "a" not in cache
    assert cache.get("a") is None
    assert cache.delete("a") is False

    cache.put("a", a)
    cache.put("b", b)
    assert len(cache) == 2
    assert cache.contains("a") and "b" in cache
    assert_same(cache.get("a"), a)
    assert_same(cache.get("b"), b)
    st = cache.stats()
    assert st["namespace"] == "test"
    assert st["entries"] == 2
    assert st["hits"] == 2 and st["misses"] == 1
    assert st["tiers"]["host"]["puts"] == 2
    assert st["tiers"]["host"]["put_bytes"] == 4 * 8192 * 2 + 3 * 100 * 4
    assert st["tiers"]["host"]["hits"] == 2
    assert st["tiers"]["host"]["hit_bytes"] == 4 * 8192 * 2 + 3 * 100 * 4
    assert st["tiers"]["host"]["entries"] == 2
    # 64 KiB blocks: a is 64 KiB (1 block), b is 1200 B (1 block)
    assert st["tiers"]["host"]["used_bytes"] == 2 * 64 * KiB

    assert cache.delete("a") is True
    assert cache.delete("a") is False
    assert not cache.contains("a")
    assert cache.get("a") is None
    assert len(cache) == 1
    assert_same(cache.get("b"), b)
    st = cache.stats()
    assert st["entries"] == 1 and st["misses"] == 2
    assert st["tiers"]["host"]["used_bytes"] == 64 * KiB
    check_quiescent(cache)


def test_stats_without_nvme_has_no_nvme_section(tmp_path):
    cache = TieredCache(CacheConfig(host=HostTierConfig(capacity_bytes=1 * MiB, block_bytes=64 * KiB)))
    try:
        st = cache.stats()
        assert set(st["tiers"]) == {"host"}
        assert st["namespace"] == "default"
        assert st["tiers"]["host"]["capacity_bytes"] == 1 * MiB
    finally:
        cache.close()


@pytest.mark.parametrize("where", ["host", "nvme", "restart"])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_round_trip_byte_exact(make_cache, tmp_path, dtype, where):
    """Every dtype and shape comes back with the same dtype, shape and bytes (NaN payloads included),
    from host memory, from NVMe (host tier disabled) and after a restart."""
    host = 0 if where == "nvme" else 1 * MiB
    cache, cfg = make_cache(host_bytes=host, nvme_bytes=2 * MiB)
    tensors = {f"k{i}": random_tensor(shape, dtype, seed=i) for i, shape in enumerate(SHAPES)}
    for k, t in tensors.items():
        cache.put(k, t)
    if where == "restart":
        cache.close()
        cache = TieredCache(cfg)
        try:
            assert len(cache) == len(tensors)
            for k, t in tensors.items():
                assert_same(cache.get(k), t)
        finally:
            cache.close()
        return
    if where == "nvme":
        assert cache.stats()["tiers"]["nvme"]["entries"] == len(tensors)
    for k, t in tensors.items():
        got = cache.get(k)
        assert_same(got, t)
        assert got.is_contiguous()


def test_float_specials_survive(make_cache):
    """Signed zeros, infinities and NaNs with distinct payloads keep their exact bits."""
    cache, _ = make_cache(host_bytes=0)
    words = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFFF, 0x7F81]
    bits = torch.tensor([w - 0x10000 if w >= 0x8000 else w for w in words], dtype=torch.int16)
    t = bits.view(torch.bfloat16)
    cache.put("specials", t)
    got = cache.get("specials")
    assert got.view(torch.int16).tolist() == bits.tolist()


@pytest.mark.parametrize("host_bytes", [1 * MiB, 0], ids=["host", "nvme"])
def test_non_contiguous_inputs_stored_in_c_order(make_cache, host_bytes):
    cache, _ = make_cache(host_bytes=host_bytes)
    base = torch.arange(16 * 24, dtype=torch.float32).reshape(16, 24)
    views = {
        "transposed": base.t(),
        "stepped": base[::3, 1::4],
        "expanded": torch.arange(8, dtype=torch.bfloat16).expand(5, 8),
        "permuted3d": base.reshape(4, 4, 24).permute(2, 0, 1),
        "negstride_like": base.flip(0)[:, ::2],
    }
    for name, v in views.items():
        assert not v.is_contiguous()
        cache.put(name, v)
    for name, v in views.items():
        got = cache.get(name)
        # independent expectation: the values in logical order, rebuilt from Python lists
        expected = torch.tensor(v.tolist(), dtype=v.dtype)
        assert_same(got, expected)
        assert got.is_contiguous()


@pytest.mark.parametrize("host_bytes", [1 * MiB, 0], ids=["host", "nvme"])
def test_mutating_source_after_put_does_not_change_entry(make_cache, host_bytes):
    cache, _ = make_cache(host_bytes=host_bytes)
    src = random_tensor((8, 8192), torch.bfloat16, 5)
    snapshot = raw_bytes(src)
    cache.put("k", src)
    src.view(torch.int16).fill_(0x1234)
    got = cache.get("k")
    assert raw_bytes(got) == snapshot


@pytest.mark.parametrize("host_bytes", [1 * MiB, 0, 128 * KiB], ids=["host", "nvme", "promoted"])
def test_get_returns_a_new_tensor_each_time(make_cache, host_bytes):
    cache, _ = make_cache(host_bytes=host_bytes)
    src = random_tensor((4, 8192), torch.bfloat16, 6)  # 64 KiB
    cache.put("k", src)
    if host_bytes == 128 * KiB:  # push k to NVMe so the first get is a promotion
        cache.put("f1", filled(64 * KiB, 1))
        assert testing.write_behind_idle(cache)  # else its pin on k (a write in flight) turns f2's eviction to f1
        cache.put("f2", filled(64 * KiB, 2))
        assert not host_holds(cache, "k") and nvme_holds(cache, "k")
    a = cache.get("k")
    b = cache.get("k")
    assert a.data_ptr() != b.data_ptr()
    a.view(torch.int16).fill_(7)
    b.view(torch.int16).fill_(9)
    assert_same(cache.get("k"), src)


# ============================================================================ namespaces


def test_namespaces_separate_entries(make_cache, tmp_path):
    cache, cfg = make_cache(host_bytes=1 * MiB)
    t1, t2, t3 = (random_tensor((10,), torch.float32, s) for s in (1, 2, 3))
    cache.put("k", t1, namespace="model-a")
    cache.put("k", t2, namespace="model-b")
    cache.put("k", t3)  # config namespace "test"
    assert len(cache) == 3
    assert_same(cache.get("k", namespace="model-a"), t1)
    assert_same(cache.get("k", namespace="model-b"), t2)
    assert_same(cache.get("k"), t3)
    assert_same(cache.get("k", namespace="test"), t3)
    assert cache.get("k", namespace="model-c") is None
    assert not cache.contains("k", namespace="model-c")
    # length-prefixed identity: ("ab", "c") is not ("a", "bc")
    cache.put("c", t1, namespace="ab")
    assert cache.get("bc", namespace="a") is None
    assert cache.delete("k", namespace="model-a") is True
    assert cache.get("k", namespace="model-a") is None
    assert_same(cache.get("k", namespace="model-b"), t2)
    assert_same(cache.get("k"), t3)
    cache.close()
    reopened = TieredCache(cfg)  # namespaces are part of the stored identity on NVMe too
    try:
        assert_same(reopened.get("k", namespace="model-b"), t2)
        assert_same(reopened.get("k"), t3)
        assert reopened.get("k", namespace="model-a") is None
        assert reopened.get("bc", namespace="a") is None
        assert_same(reopened.get("c", namespace="ab"), t1)
    finally:
        reopened.close()


def test_default_namespace_is_config_namespace():
    cache = TieredCache(CacheConfig(host=HostTierConfig(capacity_bytes=256 * KiB, block_bytes=64 * KiB)))
    try:
        t = random_tensor((3,), torch.int64, 1)
        cache.put("k", t)
        assert_same(cache.get("k", namespace="default"), t)
        assert cache.get("k", namespace="other") is None
    finally:
        cache.close()


@pytest.mark.parametrize("bad", ["", 7, b"ns"])
def test_bad_namespace_raises_naming_namespace(make_cache, bad):
    cache, _ = make_cache()
    t = random_tensor((3,), torch.int64, 1)
    cache.put("k", t)
    for call in (lambda: cache.put("k", t, namespace=bad), lambda: cache.get("k", namespace=bad),
                 lambda: cache.contains("k", namespace=bad), lambda: cache.delete("k", namespace=bad)):
        with pytest.raises(InvalidKeyError, match="namespace"):
            call()
    assert len(cache) == 1
    assert_same(cache.get("k"), t)
