"""GPU tier logic, run on the CPU (no CUDA needed): config, puts, LRU demotion and promotion,
oversized entries, overwrites, flush, prefetch, and random operations against a model.

``ectier.testing.make_cache(config, copy_engine=..., gpu_device="cpu")`` puts the GPU
tier's arena in CPU memory and routes every copy through the given engine; here mostly
:class:`~ectier.copy.InlineCopyEngine`, which copies at once. With the hook a CPU tensor stands
for a tensor on the GPU tier's device. Copies in flight, the copy engines and threads:
test_gpu_tier_copies.py. Helpers (``cfg``, ``where``, the caches): tests/gpu_tier_helpers.py.
"""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import KiB, MiB, check_quiescent, make_config, filled, random_tensor, raw_bytes
from gpu_tier_helpers import BLOCK, cache_opener, cfg, where
from ectier import (
    CacheConfig,
    ConfigError,
    GpuTierConfig,
    HostTierConfig,
    InvalidDeviceError,
    InvalidKeyError,
    LoadHandle,
    PutHandle,
    TieredCache,
)
from ectier.copy import InlineCopyEngine
from ectier.entry import entry_digest
from ectier import testing

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def open_cache():
    with cache_opener() as make:
        yield make


# ------------------------------------------------------------------------------------ config


def test_gpu_config_defaults_disabled_and_validates_fields():
    c = CacheConfig()
    assert not c.gpu.enabled and c.gpu.capacity_bytes == 0 and c.gpu.device == "cuda:0"
    for bad, field in [({"device": "cuda"}, "gpu.device"), ({"device": "cpu"}, "gpu.device"),
                       ({"device": "cuda:x"}, "gpu.device"), ({"block_bytes": 3 * MiB}, "gpu.block_bytes"),
                       ({"capacity_bytes": 1024}, "gpu.capacity_bytes"), ({"policy": "fifo"}, "gpu.policy"),
                       ({"copy_streams": 0}, "gpu.copy_streams")]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            GpuTierConfig(**bad)
    g = CacheConfig.from_dict({"gpu": {"device": "cuda:1", "capacity_bytes": "2GiB"}}).gpu
    assert g.capacity_bytes == 2 << 30 and g.device_index == 1
    env = CacheConfig.from_env({"ECTIER_GPU__CAPACITY_BYTES": "64MiB", "ECTIER_GPU__DEVICE": "cuda:2"})
    assert env.gpu.capacity_bytes == 64 * MiB and env.gpu.device == "cuda:2"
    assert CacheConfig.from_dict(c.to_dict()) == c


def test_gpu_only_config_is_valid_but_no_tier_at_all_is_not():
    CacheConfig(host=HostTierConfig(capacity_bytes=0), gpu=GpuTierConfig(capacity_bytes=MiB))
    with pytest.raises(ConfigError, match="host.capacity_bytes"):
        CacheConfig(host=HostTierConfig(capacity_bytes=0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's error")
def test_gpu_tier_on_a_machine_without_cuda_is_a_config_error():
    with pytest.raises(ConfigError, match=r"gpu\.capacity_bytes.*CUDA is not available"):
        TieredCache(CacheConfig(gpu=GpuTierConfig(capacity_bytes=MiB), host=HostTierConfig(capacity_bytes=MiB)))


def test_device_index_that_does_not_exist_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"gpu\.device: 'cuda:2' does not exist; this machine has 2"):
        TieredCache(CacheConfig(gpu=GpuTierConfig(device="cuda:2", capacity_bytes=MiB),
                                host=HostTierConfig(capacity_bytes=MiB, pin_memory=False)))


def test_budget_larger_than_free_device_memory_names_the_field(monkeypatch):
    from ectier.tiers.gpu import GpuTier

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev=None: (MiB, 80 << 30))
    with pytest.raises(ConfigError, match=r"gpu\.capacity_bytes: .* has 1048576 of"):
        GpuTier(GpuTierConfig(capacity_bytes=2 * MiB), device=torch.device("cuda:0"), engine=InlineCopyEngine())


def test_bare_cuda_and_missing_devices_are_refused_by_get_and_prefetch(open_cache):
    c = open_cache(cfg())
    for bad in ("cuda", "cuda:99", "tpu:0"):
        with pytest.raises(InvalidDeviceError, match="device"):
            c.get("k", device=bad)
        with pytest.raises(InvalidDeviceError, match="device"):
            c.prefetch(["k"], device=bad)
    with pytest.raises(InvalidKeyError, match="keys"):
        c.prefetch("k")


def test_the_daemon_refuses_a_gpu_tier():
    from ectier import EctierError
    from ectier.daemon.server import DaemonServer

    with pytest.raises(EctierError, match=r"gpu\.capacity_bytes: the daemon has no GPU tier"):
        DaemonServer(CacheConfig(gpu=GpuTierConfig(capacity_bytes=MiB), host=HostTierConfig(capacity_bytes=MiB)))


# -------------------------------------------------------------------------- GPU tier: basics


def test_put_to_the_gpu_tier_returns_a_done_handle_and_gets_are_gpu_hits(open_cache):
    c = open_cache(cfg())
    t = random_tensor((100, 64), torch.bfloat16, seed=1)
    h = c.put("a", t)
    assert isinstance(h, PutHandle) and h.key == "a" and h.wait(1) and h.done() and h.error is None
    assert where(c, "a") == {"gpu"}
    got = c.get("a")
    assert raw_bytes(got) == raw_bytes(t) and got.dtype == torch.bfloat16 and got.shape == (100, 64)
    st = c.stats()
    assert st["tiers"]["gpu"]["puts"] == 1 and st["tiers"]["gpu"]["hits"] == 1 and st["hits"] == 1
    assert st["tiers"]["gpu"]["device"] == "cpu" and st["in_flight"] == 0
    out = torch.empty(100, 64, dtype=torch.bfloat16)
    assert c.get("a", out=out) is out and raw_bytes(out) == raw_bytes(t)
    assert "a" in c and len(c) == 1 and c.delete("a") and c.get("a") is None and where(c, "a") == set()
    check_quiescent(c)


def test_cpu_tensor_put_without_gpu_tier_still_returns_a_done_handle(make_cache):
    cache, _ = make_cache(nvme=False)
    h = cache.put("k", filled(1000, 1))
    assert h.done() and h.wait() is True and h.error is None and "stored" in repr(h)


def test_lru_victims_demote_to_host_and_hits_promote_back(open_cache):
    c = open_cache(cfg(gpu_blocks=3, host_blocks=8))
    ts = {f"k{i}": filled(BLOCK, i) for i in range(5)}
    for k, t in ts.items():
        c.put(k, t)
    assert where(c, "k0") == {"host"} and where(c, "k1") == {"host"}
    assert all(where(c, f"k{i}") == {"gpu"} for i in (2, 3, 4))
    st = c.stats()["tiers"]
    assert st["gpu"]["evictions"] == 2 and st["gpu"]["demotions"] == 2 and st["gpu"]["drops"] == 0
    # a host hit asked for the GPU tier's device is promoted; the LRU GPU entry (k2) demotes
    assert raw_bytes(c.get("k0")) == raw_bytes(ts["k0"])
    assert "gpu" in where(c, "k0") and where(c, "k2") == {"host"}
    assert c.stats()["tiers"]["gpu"]["promotions"] == 1
    # every key still reads back its own bytes
    for k, t in ts.items():
        assert raw_bytes(c.get(k)) == raw_bytes(t), k
    check_quiescent(c)


def test_gpu_only_cache_drops_victims(open_cache):
    config = CacheConfig(namespace="test", host=HostTierConfig(capacity_bytes=0),
                         gpu=GpuTierConfig(capacity_bytes=2 * BLOCK, block_bytes=BLOCK))
    c = open_cache(config)
    for i in range(3):
        c.put(f"k{i}", filled(BLOCK, i))
    assert c.get("k0") is None and raw_bytes(c.get("k2")) == raw_bytes(filled(BLOCK, 2))
    assert c.stats()["tiers"]["gpu"]["drops"] == 1 and len(c) == 2
    check_quiescent(c)


def test_entry_larger_than_gpu_budget_skips_to_host(open_cache):
    c = open_cache(cfg(gpu_blocks=2, host_blocks=8))
    t = filled(3 * BLOCK, 9)
    c.put("big", t)
    assert where(c, "big") == {"host"} and c.stats()["tiers"]["gpu"]["skipped_too_large"] == 1
    assert raw_bytes(c.get("big")) == raw_bytes(t)
    assert c.stats()["tiers"]["gpu"]["skipped_too_large"] == 2  # the promotion skipped too
    check_quiescent(c)


def test_different_block_sizes_and_fragmented_arenas_keep_bytes_exact(open_cache):
    # GPU blocks of 128 KiB, host blocks of 64 KiB: demotion pairs runs of different lengths
    c = open_cache(cfg(gpu_blocks=4, host_blocks=10, gpu_block=2 * BLOCK))
    sizes = [BLOCK + 5, 3 * BLOCK - 7, 2 * BLOCK, 5 * BLOCK + 1, 100, 4 * BLOCK]
    ts = {f"k{i}": filled(n, i + 20) for i, n in enumerate(sizes)}
    for k, t in ts.items():
        c.put(k, t)
    c.delete("k1")
    ts.pop("k1")
    for i in range(6, 10):
        ts[f"k{i}"] = filled(sizes[i % 6] + 3, i + 20)
        c.put(f"k{i}", ts[f"k{i}"])
    for k, t in ts.items():
        got = c.get(k)
        if got is not None:  # host may have dropped some (no NVMe)
            assert raw_bytes(got) == raw_bytes(t), k
    check_quiescent(c)


def test_overwrite_on_gpu_removes_older_host_and_nvme_copies(open_cache, tmp_path):
    c = open_cache(cfg(tmp_path, gpu_blocks=2, host_blocks=4, nvme_bytes=2 * MiB))
    old = filled(BLOCK, 1)
    c.put("k", old)
    c.put("x", filled(BLOCK, 2))
    c.put("y", filled(BLOCK, 3))  # k demotes to host
    assert where(c, "k") == {"host"}
    assert c.flush() >= 1 and "nvme" in where(c, "k")
    new = filled(BLOCK, 4)
    c.put("k", new)
    assert where(c, "k") == {"gpu"}
    assert raw_bytes(c.get("k")) == raw_bytes(new)
    check_quiescent(c)


def test_a_newer_version_stored_below_drops_the_older_gpu_copy(open_cache):
    c = open_cache(cfg(gpu_blocks=2, host_blocks=8))
    c.put("k", filled(BLOCK, 1))
    assert where(c, "k") == {"gpu"}
    big = filled(3 * BLOCK, 2)  # larger than the GPU budget: goes to the host
    c.put("k", big)
    assert where(c, "k") == {"host"}
    assert raw_bytes(c.get("k")) == raw_bytes(big)
    check_quiescent(c)


def test_flush_writes_gpu_only_entries_to_nvme_and_a_restart_serves_them(tmp_path):
    config = cfg(tmp_path, gpu_blocks=4, host_blocks=4, nvme_bytes=2 * MiB)
    t = filled(BLOCK + 17, 5)
    c = testing.make_cache(config, copy_engine=InlineCopyEngine(), gpu_device="cpu")
    c.put("k", t)
    assert where(c, "k") == {"gpu"}
    c.close()  # flush_on_close
    c2 = TieredCache(config.replace(gpu=GpuTierConfig()))
    try:
        assert raw_bytes(c2.get("k")) == raw_bytes(t)
    finally:
        c2.close()


def test_nvme_hit_promotes_through_host_to_gpu(open_cache, tmp_path):
    c = open_cache(cfg(tmp_path, gpu_blocks=1, host_blocks=1, nvme_bytes=2 * MiB))
    a, b, d = filled(BLOCK, 1), filled(BLOCK, 2), filled(BLOCK, 3)
    c.put("a", a)
    c.put("b", b)  # a -> host
    # the host's write-behind of a, if still in flight, pins it: b's demotion would wait for it
    # only host.admit_wait_s (0.2 s), then give up on the host
    assert testing.write_behind_idle(c)
    c.put("d", d)  # b -> host, a -> nvme
    assert where(c, "a") == {"nvme"}
    assert raw_bytes(c.get("a")) == raw_bytes(a)
    assert "gpu" in where(c, "a")
    for k, t in (("a", a), ("b", b), ("d", d)):
        assert raw_bytes(c.get(k)) == raw_bytes(t)
    check_quiescent(c)


def test_oom_during_promotion_leaves_the_entry_served_from_the_host(open_cache):
    class OomOnArena(InlineCopyEngine):
        armed = False

        def copy(self, pairs, *, lane):
            if self.armed and lane == "arena":
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return super().copy(pairs, lane=lane)

    e = OomOnArena()
    c = open_cache(cfg(gpu_blocks=1, host_blocks=4), e)
    a, b = filled(BLOCK, 1), filled(BLOCK, 2)
    c.put("a", a)
    c.put("b", b)  # a -> host
    e.armed = True
    assert raw_bytes(c.get("a")) == raw_bytes(a)
    assert where(c, "a") == {"host"}
    assert c.stats()["tiers"]["gpu"]["promotion_failures"] == 1
    e.armed = False
    assert raw_bytes(c.get("a")) == raw_bytes(a) and "gpu" in where(c, "a")
    check_quiescent(c)


# ---------------------------------------------------------------------------------- prefetch


def test_prefetch_promotes_nvme_entries_into_the_gpu_tier(open_cache, tmp_path):
    c = open_cache(cfg(tmp_path, gpu_blocks=2, host_blocks=2, nvme_bytes=4 * MiB))
    ts = {f"k{i}": filled(BLOCK, i) for i in range(6)}
    for k, t in ts.items():
        c.put(k, t)
        # the host's write-behind pins the entry it writes: an eviction meanwhile would pass k0 over
        assert testing.write_behind_idle(c)
    assert where(c, "k0") == {"nvme"}
    hs = c.prefetch(["k0", "missing", "k5"], device="cpu")
    assert all(isinstance(h, LoadHandle) for h in hs) and [h.key for h in hs] == ["k0", "missing", "k5"]
    assert [h.wait(5) for h in hs] == [True, False, True]
    assert "gpu" in where(c, "k0") and "ready" in repr(hs[0]) and "miss" in repr(hs[1])
    before = c.stats()["tiers"]["gpu"]["hits"]
    assert raw_bytes(c.get("k0")) == raw_bytes(ts["k0"])
    assert c.stats()["tiers"]["gpu"]["hits"] == before + 1
    testing.drain(c, 5)
    check_quiescent(c)


def test_prefetch_into_the_gpu_tier_when_the_host_tier_has_no_room(open_cache, tmp_path):
    # every host block pinned by a reader: the entry goes from NVMe to the GPU tier directly
    c = open_cache(cfg(tmp_path, gpu_blocks=2, host_blocks=2, nvme_bytes=4 * MiB))
    ts = {f"k{i}": filled(BLOCK, i) for i in range(6)}
    for k, t in ts.items():
        c.put(k, t)
        assert testing.write_behind_idle(c)
    leases = [c.acquire(k, promote=False) for k in ("k2", "k3")]
    try:
        assert all(lease is not None for lease in leases) and where(c, "k0") == {"nvme"}
        (h,) = c.prefetch(["k0"], device="cpu")
        assert h.wait(5) and "gpu" in where(c, "k0")
    finally:
        for lease in leases:
            c.release(lease)
    assert raw_bytes(c.get("k0", device="cpu")) == raw_bytes(ts["k0"])
    testing.drain(c, 5)
    check_quiescent(c)


def test_prefetch_without_gpu_device_stops_at_the_host(make_cache):
    cache, _ = make_cache(host_bytes=2 * 64 * KiB, nvme_bytes=2 * MiB)
    for i in range(4):
        cache.put(f"k{i}", filled(64 * KiB, i))
    (h,) = cache.prefetch(["k0"])
    assert h.wait(5) and testing.tier(cache, "host").index.lookup(entry_digest("test", "k0")) is not None
    (h,) = cache.prefetch(["k0"])
    assert h.done() and h.wait(0)  # already there: done at once


def test_prefetch_of_an_entry_too_large_for_the_host_reads_nothing(tmp_path):
    config = dataclasses.replace(make_config(tmp_path, host_bytes=2 * 64 * KiB, nvme_bytes=2 * MiB),
                                 prefetch_threads=1)
    with TieredCache(config) as cache:
        cache.put("big", filled(3 * 64 * KiB, 1))
        with cache.background_read():  # the one slot is busy: a promotion would have to wait
            (h,) = cache.prefetch(["big"])
            assert h.done() and h.wait(0)  # NVMe is the highest tier it fits: done at once, found
        assert cache.stats()["tiers"]["nvme"]["hits"] == 0  # nothing to promote into: not read


# --------------------------------------------------------------------- randomized vs a model


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_match_a_plain_dict(open_cache, tmp_path, seed):
    rng = random.Random(seed)
    c = open_cache(cfg(tmp_path / str(seed), gpu_blocks=3, host_blocks=4, nvme_bytes=(2 * MiB if seed else 0),
                       gpu_block=(2 * BLOCK if seed == 2 else BLOCK)))
    model: dict[str, bytes] = {}
    for step in range(150):
        k = f"k{rng.randrange(8)}"
        op = rng.random()
        if op < 0.45:
            t = filled(rng.choice([100, BLOCK, BLOCK + 1, 2 * BLOCK - 3]), step)
            c.put(k, t)
            model[k] = raw_bytes(t)
        elif op < 0.8:
            got = c.get(k)
            if got is not None:
                assert raw_bytes(got) == model[k], (step, k)
            elif seed:  # with NVMe nothing is ever dropped at these sizes
                assert k not in model, (step, k)
            else:  # without NVMe, host victims are dropped
                model.pop(k, None)
        elif op < 0.9:
            for h in c.prefetch([k], device="cpu"):
                h.wait(5)
        else:
            existed = c.delete(k)
            assert existed == (k in model) if seed else (not existed or k in model), (step, k)
            model.pop(k, None)
    testing.drain(c, 5)
    check_quiescent(c)
    for k, b in model.items():
        got = c.get(k)
        assert (got is not None and raw_bytes(got) == b) or not seed


# ----------------------------------------------------------------------------- the GPU suite


def test_gpu_suite_exits_cleanly_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the suite would run")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "no CUDA" in r.stdout


def test_gpu_suite_runs_every_test_file_with_gpu_tests():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    import re

    uses = re.compile(r"^\s*(@pytest\.mark\.gpu|pytestmark\s*=.*pytest\.mark\.gpu)", re.M)  # a decorator or the module's mark
    marked = {str(p.relative_to(ROOT)) for d in ("tests", "tests_vllm") for p in (ROOT / d).glob("test_*.py")
              if uses.search(p.read_text())}
    assert marked and marked <= set(suite.GPU_TEST_FILES), marked - set(suite.GPU_TEST_FILES)
