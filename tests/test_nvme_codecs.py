"""NVMe tier codecs and LMDB map, through TieredCache: every codec round trips across a restart,
codecs mix in one store, the map grows from a tiny initial size, and its ceiling fails only the
put (or the demotion) that hits it."""

from __future__ import annotations

import pytest
import torch

from ectier import TierWriteError
from ectier.codec import registered_codecs

from conftest import KiB, MiB, assert_same, check_budgets, check_quiescent, digest, filled, nvme_holds, random_tensor
from ectier import testing

from nvme_helpers import assert_reopened_serves, normal_bf16, reopen


# ============================================================================ codecs


@pytest.mark.parametrize("codec", ["raw", "zstd", "zstd-planes"])
def test_codecs_round_trip_with_restart(make_cache, codec):
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=4 * MiB, codec=codec)
    vals = {
        "normal": normal_bf16((16, 8192), 1),  # 256 KiB, compressible after the plane split
        "random": random_tensor((8, 8192), torch.bfloat16, 2),
        "int64": torch.arange(5000, dtype=torch.int64) * 3,
        "bool": random_tensor((33, 7), torch.bool, 3),
        "f32": random_tensor((3, 5, 7), torch.float32, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.empty(0, 8192, dtype=torch.bfloat16),
    }
    for t in (random_tensor((77,), dt, 5) for dt in (torch.float8_e4m3fn,) if hasattr(torch, "float8_e4m3fn")):
        vals["fp8"] = t
    for k, t in vals.items():
        cache.put(k, t)
    cid = registered_codecs()[codec]
    for k in vals:
        assert testing.tier(cache, "nvme").record(digest(k)).header.codec_id == cid
    for k, t in vals.items():
        assert_same(cache.get(k), t)
    if codec == "zstd-planes":
        hdr = testing.tier(cache, "nvme").record(digest("normal")).header
        assert hdr.payload_nbytes < 0.8 * hdr.raw_nbytes
    if codec == "raw":
        hdr = testing.tier(cache, "nvme").record(digest("normal")).header
        assert hdr.payload_nbytes == hdr.raw_nbytes
    cache.close()
    assert_reopened_serves(cfg, vals)


def test_mixed_codecs_in_one_store(make_cache):
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=4 * MiB, codec="zstd")
    z = normal_bf16((8, 8192), 1)
    cache.put("z", z)
    cache.close()
    raw = reopen(cfg, codec="raw")  # reads records written with zstd
    try:
        assert_same(raw.get("z"), z)
        r = normal_bf16((8, 8192), 2)
        raw.put("r", r)
        assert testing.tier(raw, "nvme").record(digest("r")).header.codec_id == registered_codecs()["raw"]
    finally:
        raw.close()
    planes = reopen(cfg, codec="zstd-planes")
    try:
        assert_same(planes.get("z"), z)
        assert_same(planes.get("r"), r)
        p = normal_bf16((8, 8192), 3)
        planes.put("p", p)
        ids = {k: testing.tier(planes, "nvme").record(digest(k)).header.codec_id for k in "zrp"}
        assert ids == {"z": registered_codecs()["zstd"], "r": registered_codecs()["raw"],
                       "p": registered_codecs()["zstd-planes"]}
        assert_same(planes.get("p"), p)
    finally:
        planes.close()


def test_promotion_from_compressed_record(make_cache):
    cache, _ = make_cache(host_bytes=2 * 64 * KiB, codec="zstd-planes")
    vals = {f"k{i}": normal_bf16((4, 8192), i) for i in range(4)}
    for k, t in vals.items():
        cache.put(k, t)
    # the write-behind may still be writing k0 (pinned in the host meanwhile, so the evictions took
    # the others): k0 is on NVMe once it is done
    assert testing.write_behind_idle(cache)
    assert nvme_holds(cache, "k0")
    for k, t in vals.items():
        assert_same(cache.get(k), t)
    assert cache.stats()["tiers"]["host"]["promotions"] >= 2


# ============================================================================ map size


def test_map_grows_from_a_tiny_initial_map(make_cache):
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=8 * MiB, map_initial_bytes=1 * MiB)
    # layout v2: the map holds index entries only; 60 KiB keys make 12 of them ~720 KiB of headers
    vals = {f"k{i}".ljust(60 * KiB, "x"): filled(4 * KiB, i) for i in range(24)}  # 1.4 MiB in a 1 MiB map
    for k, t in vals.items():
        cache.put(k, t)
    st = cache.stats()["tiers"]["nvme"]
    assert st["map_growths"] > 0
    assert st["map_size_bytes"] > 1 * MiB
    assert st["entries"] == 24 and st["write_failures"] == 0
    for k, t in vals.items():
        assert_same(cache.get(k), t)
    cache.close()
    assert_reopened_serves(cfg, vals)


def test_map_ceiling_fails_that_put_only(make_cache):
    cache, _ = make_cache(host_bytes=0, nvme_bytes=8 * MiB, map_initial_bytes=1 * MiB, map_max_bytes=2 * MiB)
    stored = {}
    key = lambda i: f"k{i}".ljust(60 * KiB, "x")  # noqa: E731 - the index entry is ~60 KiB
    with pytest.raises(TierWriteError, match="map"):
        for i in range(64):  # 3.8 MiB of index entries into a map capped at 2 MiB
            t = filled(4 * KiB, i)
            cache.put(key(i), t)
            stored[key(i)] = t
    failed = key(len(stored))
    assert 8 <= len(stored) < 40
    assert not cache.contains(failed) and cache.get(failed) is None
    assert len(cache) == len(stored)
    st = cache.stats()["tiers"]["nvme"]
    assert st["write_failures"] == 1 and st["write_errors"] >= 1
    assert st["map_size_bytes"] <= 2 * MiB
    for k, t in stored.items():
        assert_same(cache.get(k), t)
    # the store keeps working: free a record, then a smaller write fits
    assert cache.delete(key(0))
    cache.put("small", filled(64 * KiB, 99))
    assert_same(cache.get("small"), filled(64 * KiB, 99))
    check_quiescent(cache)


def test_map_ceiling_during_demotion_drops_the_victim_not_the_put(make_cache):
    cache, _ = make_cache(host_bytes=2 * 128 * KiB, nvme_bytes=8 * MiB, map_initial_bytes=1 * MiB,
                          map_max_bytes=1 * MiB)
    key = lambda i: f"k{i}".ljust(60 * KiB, "x")  # noqa: E731 - the index entry is ~60 KiB
    for i in range(40):
        cache.put(key(i), filled(64 * KiB, i))  # never raises: a failed demotion drops the victim
        check_budgets(cache)
    st = cache.stats()["tiers"]
    assert st["nvme"]["write_failures"] >= 1
    assert st["host"]["drops"] >= 1
    assert cache.contains(key(38)) and cache.contains(key(39))
    for i in range(40):
        got = cache.get(key(i))
        if got is not None:
            assert_same(got, filled(64 * KiB, i))
    check_quiescent(cache)


def _xor_codec_class():
    """A codec a plugin would register (id 201, ``test-xor``): the bytes XOR 0x5A."""
    import numpy as np

    from ectier.codec import Codec

    class XorCodec(Codec):
        codec_id = 201
        name = "test-xor"
        params = ("level",)

        def __init__(self, level: int = 1) -> None:
            self.level = level

        def encode(self, data, itemsize):
            return (np.frombuffer(memoryview(data), dtype=np.uint8) ^ 0x5A).tobytes()

        def decode_into(self, payload, out, itemsize):
            np.bitwise_xor(np.frombuffer(memoryview(payload), dtype=np.uint8), 0x5A,
                           out=np.frombuffer(memoryview(out), dtype=np.uint8))

    return XorCodec


def test_a_record_of_a_codec_not_registered_here_is_a_miss_after_a_restart(make_cache):
    """A store written with a plugin's codec, reopened by a process that did not register it (the
    plugin not imported): its records are misses, quarantined and counted — never an
    ``UnknownCodecError`` out of ``get`` (it was, for every record scanned at open), and a put of
    the key stores it again."""
    from ectier.codec import register_codec
    from ectier.testing_internals import isolated_codec_registry

    with isolated_codec_registry():
        register_codec(_xor_codec_class())
        cache, cfg = make_cache(host_bytes=0, nvme_bytes=4 * MiB, codec="test-xor")
        t = random_tensor((4, 512), torch.bfloat16, 1)
        cache.put("x", t)
        assert_same(cache.get("x"), t)
        cache.close()
    with reopen(cfg, codec="raw") as again:
        assert again.get("x") is None
        st = again.stats()["tiers"]["nvme"]
        assert st["checksum_failures"] == 1 and st["quarantined"] == 1
        again.put("x", t)
        assert_same(again.get("x"), t)
        check_quiescent(again)
