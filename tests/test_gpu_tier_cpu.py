"""GPU tier and copy-engine logic, run on the CPU (no CUDA needed).

``ectier.testing.make_cache(config, copy_engine=..., gpu_device="cpu")`` puts the GPU
tier's arena in CPU memory and routes every copy through the given engine:

- :class:`~ectier.copy.InlineCopyEngine` copies at once: LRU, demotion, promotion, flush logic;
- :class:`~ectier.copy.DeferredCopyEngine` runs copies only when the test says so (in submission
  order, as one CUDA stream would): in-flight visibility, overwrite and delete while in flight,
  failed copies — deterministically, without sleeps.

With the hook a CPU tensor stands for a tensor on the GPU tier's device.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from conftest import KiB, MiB, check_quiescent, filled, random_tensor, raw_bytes
from ectier import (
    CacheConfig,
    ConfigError,
    GpuTierConfig,
    HostTierConfig,
    InvalidDeviceError,
    InvalidKeyError,
    LoadHandle,
    NvmeTierConfig,
    PutHandle,
    TieredCache,
)
from ectier.copy import Completer, CopyHandle, CudaCopyEngine, InlineCopyEngine
from ectier.testing import DeferredCopyEngine
from ectier.entry import entry_digest
from ectier import testing

BLOCK = 64 * KiB
ROOT = Path(__file__).resolve().parents[1]


def cfg(tmp_path=None, *, gpu_blocks=4, host_blocks=4, nvme_bytes=0, gpu_block=BLOCK, host_block=BLOCK, **gpu_kw):
    return CacheConfig(
        namespace="test",
        gpu=GpuTierConfig(capacity_bytes=gpu_blocks * gpu_block, block_bytes=gpu_block, **gpu_kw),
        host=HostTierConfig(capacity_bytes=host_blocks * host_block, block_bytes=host_block, pin_memory=False,
                            admit_wait_s=0.2),
        nvme=NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=nvme_bytes, sync=False,
                            map_initial_bytes=4 * MiB) if nvme_bytes else NvmeTierConfig(),
    )


class pumping:
    """Context manager: a thread runs the deferred engine's copies as they come (a live GPU)."""

    def __init__(self, engine: DeferredCopyEngine) -> None:
        self.engine, self.stop = engine, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.engine.complete()
            self.stop.wait(0.002)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


@pytest.fixture
def open_cache():
    caches = []

    def make(config, engine=None):
        c = testing.make_cache(config, copy_engine=engine or InlineCopyEngine(), gpu_device="cpu")
        caches.append((c, engine))
        return c

    yield make
    for c, engine in caches:
        if isinstance(engine, DeferredCopyEngine):
            engine.fail_with = None
            with pumping(engine):  # copies enqueued by close() itself (flush) must run too
                c.close()
        else:
            c.close()


def where(cache, key):
    return testing.where(cache, key, "test")


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


# ------------------------------------------------------------------------------ copy engines


def test_inline_engine_copies_at_once_and_reports_errors_in_the_handle():
    e = InlineCopyEngine()
    dst, src = torch.zeros(8, dtype=torch.uint8), torch.arange(8, dtype=torch.uint8)
    h = e.copy([(dst, src)], lane="d2h")
    assert h.done() and h.wait(0) and h.error is None and dst.tolist() == list(range(8))
    bad = e.copy([(torch.zeros(4, dtype=torch.uint8).expand(2, 4)[0], torch.zeros(4, dtype=torch.uint8))],
                 lane="h2d")
    assert bad.done()
    with pytest.raises(ValueError, match="lane"):
        e.copy([(dst, src)], lane="sideways")
    with pytest.raises(ValueError, match="destination of 4 bytes, source of 8"):
        e.copy([(dst[:4], src)], lane="d2h")


def test_deferred_engine_runs_in_order_only_when_told_and_poisons_failures():
    e = DeferredCopyEngine()
    a, b = torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    h1 = e.copy([(a, torch.full((4,), 1, dtype=torch.uint8))], lane="arena")
    h2 = e.copy([(a, torch.full((4,), 2, dtype=torch.uint8))], lane="arena")
    assert not h1.done() and not h1.wait(0.01) and a.sum() == 0 and e.pending == 2
    assert e.complete(1) == 1 and h1.done() and not h2.done() and a.tolist() == [1] * 4
    e.complete()
    assert a.tolist() == [2] * 4
    e.fail_with = RuntimeError("boom")
    h3 = e.copy([(b, torch.full((4,), 7, dtype=torch.uint8))], lane="d2h")
    e.complete()
    assert h3.done() and isinstance(h3.error, RuntimeError) and b.tolist() == [0xA5] * 4


def test_cuda_engine_refuses_cpu_and_missing_devices():
    with pytest.raises(InvalidDeviceError, match="cuda:<index>"):
        CudaCopyEngine("cpu")
    with pytest.raises(InvalidDeviceError):
        CudaCopyEngine("cuda:99")


def test_completer_runs_callbacks_in_order_after_their_copies_and_survives_a_failing_one():
    e = DeferredCopyEngine()
    comp = Completer()
    ran = []
    hs = [e.copy([], lane="d2h") for _ in range(3)]
    comp.submit(hs[0], lambda: ran.append(0))
    comp.submit(hs[1], lambda: 1 / 0)
    comp.submit(hs[2], lambda: ran.append(2))
    assert not comp.drain(0.05) and ran == [] and comp.outstanding == 3
    e.complete()
    assert comp.drain(5) and ran == [0, 2]
    assert comp.close(5)
    comp.close(5)  # idempotent


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


# ------------------------------------------------------------------------ in flight (deferred)


def test_async_host_put_is_invisible_until_its_copy_completes_and_get_waits_for_it(open_cache):
    e = DeferredCopyEngine()
    config = cfg(gpu_blocks=1)
    c = testing.make_cache(config.replace(gpu=GpuTierConfig()), copy_engine=e)  # no GPU tier: async host puts
    try:
        t = filled(2 * BLOCK, 3)
        h = c.put("k", t)
        assert not h.done() and not h.wait(0.01)
        assert "k" in c and c.stats()["in_flight"] == 1
        assert testing.tier(c, "host").index.lookup(entry_digest("test", "k")) is None  # not committed
        testing.tier(c, "host").buffer.fill_(0xEE)  # poison the arena: a premature read would show it
        got = []
        reader = threading.Thread(target=lambda: got.append(c.get("k")))
        reader.start()
        reader.join(0.1)
        assert reader.is_alive() and not got, "get returned before the copy completed"
        e.complete()
        reader.join(5)
        assert h.wait(5) and h.error is None
        assert raw_bytes(got[0]) == raw_bytes(t)
        assert c.stats()["in_flight"] == 0 and c.stats()["tiers"]["host"]["puts"] == 1
        check_quiescent(c)
    finally:
        e.complete()
        c.close()


def test_overwrite_and_delete_while_in_flight_never_resurrect_old_bytes(open_cache):
    e = DeferredCopyEngine()
    c = testing.make_cache(cfg().replace(gpu=GpuTierConfig()), copy_engine=e)
    try:
        v1, v2 = filled(BLOCK, 1), filled(BLOCK, 2)
        h1, h2 = c.put("k", v1), c.put("k", v2)
        e.complete()
        assert h1.wait(5) and h2.wait(5)
        assert raw_bytes(c.get("k")) == raw_bytes(v2)
        # a put in flight, then a delete: the delete wins
        h3 = c.put("k", filled(BLOCK, 3))
        assert c.delete("k")
        e.complete()
        assert h3.wait(5)
        assert c.get("k") is None and "k" not in c
        check_quiescent(c)
    finally:
        e.complete()
        c.close()


def test_failed_copy_is_a_miss_and_keeps_the_previous_version(open_cache):
    e = DeferredCopyEngine()
    c = testing.make_cache(cfg().replace(gpu=GpuTierConfig()), copy_engine=e)
    try:
        v1 = filled(BLOCK, 1)
        c.put("k", v1)
        e.complete()
        e.fail_with = RuntimeError("copy failed (injected)")
        h = c.put("k", filled(BLOCK, 2))
        e.complete()
        assert h.wait(5) is False and isinstance(h.error, RuntimeError) and "failed" in repr(h)
        assert raw_bytes(c.get("k")) == raw_bytes(v1)
        e.fail_with = RuntimeError("again")
        h = c.put("new", filled(BLOCK, 3))
        e.complete()
        assert not h.wait(5) and c.get("new") is None and "new" not in c
        assert c.stats()["copy_failures"] == 2
        check_quiescent(c)
    finally:
        e.complete()
        c.close()


def test_gpu_put_in_flight_is_served_after_its_write_and_a_failed_write_is_a_miss(open_cache):
    e = DeferredCopyEngine()
    c = open_cache(cfg(gpu_blocks=2, host_blocks=4), e)
    t = filled(BLOCK, 7)
    h = c.put("k", t)
    assert not h.done()
    got = []
    reader = threading.Thread(target=lambda: got.append(c.get("k")))
    reader.start()
    reader.join(0.1)
    assert reader.is_alive()  # its read is queued behind the write on the arena lane
    e.complete()
    reader.join(5)
    assert h.wait(5) and raw_bytes(got[0]) == raw_bytes(t)
    # a failed write into the GPU arena: the entry is dropped, never served as garbage
    e.fail_with = RuntimeError("injected")
    h = c.put("bad", filled(BLOCK, 8))
    e.complete()
    assert not h.wait(5)
    with pumping(e):
        assert c.get("bad") is None
    assert c.stats()["tiers"]["gpu"]["copy_failures"] >= 1
    check_quiescent(c)


def test_gpu_demotion_in_flight_is_waited_for_by_get(open_cache):
    e = DeferredCopyEngine()
    c = open_cache(cfg(gpu_blocks=1, host_blocks=4), e)
    a, b = filled(BLOCK, 1), filled(BLOCK, 2)
    c.put("a", a)
    c.put("b", b)  # a's D2H demotion is queued behind a's write; b's write behind it
    assert c.stats()["in_flight"] == 1 and "a" in c
    got = []
    reader = threading.Thread(target=lambda: got.append(c.get("a")))
    reader.start()
    reader.join(0.1)
    assert reader.is_alive()
    while reader.is_alive():
        e.complete()
        reader.join(0.01)
    assert raw_bytes(got[0]) == raw_bytes(a)
    with pumping(e):
        assert raw_bytes(c.get("b", device="cpu")) == raw_bytes(b)


def test_close_waits_for_copies_in_flight(tmp_path):
    e = DeferredCopyEngine()
    c = testing.make_cache(cfg().replace(gpu=GpuTierConfig()), copy_engine=e)
    h = c.put("k", filled(BLOCK, 1))
    closer = threading.Thread(target=c.close)
    closer.start()
    closer.join(0.1)
    assert closer.is_alive() and not h.done()
    e.complete()
    closer.join(5)
    assert not closer.is_alive() and h.wait(0)


# ----------------------------------------------------------------------------------- prefetch


def test_prefetch_promotes_nvme_entries_into_the_gpu_tier(open_cache, tmp_path):
    c = open_cache(cfg(tmp_path, gpu_blocks=2, host_blocks=2, nvme_bytes=4 * MiB))
    ts = {f"k{i}": filled(BLOCK, i) for i in range(6)}
    for k, t in ts.items():
        c.put(k, t)
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


def test_prefetch_without_gpu_device_stops_at_the_host(make_cache):
    cache, _ = make_cache(host_bytes=2 * 64 * KiB, nvme_bytes=2 * MiB)
    for i in range(4):
        cache.put(f"k{i}", filled(64 * KiB, i))
    (h,) = cache.prefetch(["k0"])
    assert h.wait(5) and testing.tier(cache, "host").index.lookup(entry_digest("test", "k0")) is not None
    (h,) = cache.prefetch(["k0"])
    assert h.done() and h.wait(0)  # already there: done at once


# ---------------------------------------------------------------------- randomized vs a model


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


# ------------------------------------------------------------------------------ the GPU suite


def test_gpu_suite_exits_cleanly_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the suite would run")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "no CUDA" in r.stdout


# ------------------------------------------------------------------------- threads at once


def test_threads_with_copies_completing_asynchronously_stay_consistent(open_cache, tmp_path):
    """Four threads put/get/delete/prefetch overlapping keys while a pump thread completes the
    copies late and in order (a live GPU): every hit is bytes of some put of that key, nothing
    deadlocks, and the idle cache is consistent."""
    e = DeferredCopyEngine()
    c = open_cache(cfg(tmp_path, gpu_blocks=3, host_blocks=4, nvme_bytes=4 * MiB), e)
    written: dict[str, set[bytes]] = {f"k{i}": set() for i in range(6)}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for step in range(60):
                k = f"k{rng.randrange(6)}"
                op = rng.random()
                if op < 0.4:
                    t = filled(rng.choice([100, BLOCK, BLOCK + 9]), seed * 1000 + step)
                    with lock:
                        written[k].add(raw_bytes(t))
                    c.put(k, t)
                elif op < 0.8:
                    got = c.get(k)
                    if got is not None:
                        with lock:
                            assert raw_bytes(got) in written[k], (seed, step, k)
                elif op < 0.9:
                    c.prefetch([k], device="cpu")[0].wait(10)
                else:
                    c.delete(k)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    with pumping(e):
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "deadlock"
        testing.drain(c, 10)
    assert not errors, errors[0]
    check_quiescent(c)


def test_a_read_queued_behind_a_failing_gpu_write_is_a_miss_not_garbage(open_cache):
    e = DeferredCopyEngine()
    c = open_cache(cfg(gpu_blocks=2, host_blocks=4), e)
    h = c.put("k", filled(BLOCK, 1))
    got = []
    reader = threading.Thread(target=lambda: got.append(c.get("k")))
    reader.start()
    reader.join(0.1)
    assert reader.is_alive() and e.pending == 2  # the write, then the read behind it
    e.fail_with = RuntimeError("injected")  # the write fails and poisons its destination
    e.complete()
    reader.join(5)
    assert got == [None] and not h.wait(5)
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


def test_the_daemon_refuses_a_gpu_tier():
    from ectier import EctierError
    from ectier.daemon.server import DaemonServer

    with pytest.raises(EctierError, match=r"gpu\.capacity_bytes: the daemon has no GPU tier"):
        DaemonServer(CacheConfig(gpu=GpuTierConfig(capacity_bytes=MiB), host=HostTierConfig(capacity_bytes=MiB)))


def test_prefetch_of_an_entry_too_large_for_the_host_reads_nothing(make_cache):
    cache, _ = make_cache(host_bytes=2 * 64 * KiB, nvme_bytes=2 * MiB)
    cache.put("big", filled(3 * 64 * KiB, 1))
    (h,) = cache.prefetch(["big"])
    assert h.wait(5)
    assert cache.stats()["tiers"]["nvme"]["hits"] == 0  # nothing to promote into: not read


def test_a_failed_promotion_copy_is_served_from_the_host_copy(open_cache):
    class FailArenaWrites(InlineCopyEngine):
        armed = False
        gpu_arena = -1

        def copy(self, pairs, *, lane):
            into_gpu = bool(pairs) and pairs[0][0].untyped_storage().data_ptr() == self.gpu_arena
            if self.armed and into_gpu:
                self.armed = False
                for dst, _ in pairs:
                    dst.fill_(0xA5)  # what a failed copy may leave behind
                h = CopyHandle()
                h._finish(RuntimeError("injected copy failure"))
                return h
            return super().copy(pairs, lane=lane)

    e = FailArenaWrites()
    c = open_cache(cfg(gpu_blocks=1, host_blocks=4), e)
    a = filled(BLOCK, 1)
    c.put("a", a)
    c.put("b", filled(BLOCK, 2))  # a -> host
    assert where(c, "a") == {"host"}
    e.gpu_arena = testing.tier(c, "gpu").buffer.untyped_storage().data_ptr()
    e.armed = True  # the promotion's host -> arena copy fails (not the demotion it causes)
    assert raw_bytes(c.get("a")) == raw_bytes(a)
    assert c.stats()["tiers"]["gpu"]["copy_failures"] >= 1 and "host" in where(c, "a")
    check_quiescent(c)


def test_completer_turns_a_failing_wait_into_a_failed_copy():
    class Broken(CopyHandle):
        def wait(self, timeout_s=None):
            raise RuntimeError("CUDA error: an illegal memory access (injected)")

    comp, seen = Completer(), []
    h = Broken()
    comp.submit(h, lambda: seen.append(h.error))
    assert comp.close(5)
    assert len(seen) == 1 and isinstance(seen[0], RuntimeError) and h.done()


# ------------------------------------------- the CUDA engine's call order, with a fake torch.cuda


class _FakeCuda:
    """Records the order of the stream/event calls CudaCopyEngine makes (copies run on CPU)."""

    def __init__(self, log):
        self.log = log
        fake = self

        class Event:
            n = 0

            def __init__(self, enable_timing=False, blocking=False):
                Event.n += 1
                self.name, self.blocking, self.recorded = f"E{Event.n}", blocking, False

            def record(self, stream=None):
                fake.log.append(("record", self.name, (stream or fake.current).name))
                self.recorded = True

            def query(self):
                return self.recorded

            def synchronize(self):
                fake.log.append(("synchronize", self.name))

        class Stream:
            n = 0

            def __init__(self, device=None, priority=0):
                Stream.n += 1
                self.name = f"S{Stream.n}"

            def wait_event(self, ev):
                fake.log.append(("wait_event", self.name, ev.name))

        class _Ctx:
            def __init__(self, stream=None):
                self.stream, self.prev = stream, None

            def __enter__(self):
                if self.stream is not None:
                    self.prev, fake.current = fake.current, self.stream
                return self

            def __exit__(self, *exc):
                if self.stream is not None:
                    fake.current = self.prev

        self.Event, self.Stream = Event, Stream
        self.current = Stream()
        self.current.name = "producer"
        self.stream = _Ctx
        self.device = lambda dev: _Ctx()
        self.current_stream = lambda dev=None: fake.current


def test_cuda_engine_orders_copies_after_the_producer_and_before_the_consumer(monkeypatch):
    log: list = []
    fake = _FakeCuda(log)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name in ("Event", "Stream", "stream", "device", "current_stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    orig_copy = torch.Tensor.copy_

    def spy_copy(dst, src, non_blocking=False):
        log.append(("copy", fake.current.name, non_blocking))
        return orig_copy(dst, src)

    monkeypatch.setattr(torch.Tensor, "copy_", spy_copy)
    engine = CudaCopyEngine("cuda:0", streams_per_direction=2)
    d2h = [s.name for s in engine._lanes["d2h"]]
    dst, src = torch.zeros(8, dtype=torch.uint8), torch.arange(8, dtype=torch.uint8)
    log.clear()
    h = engine.copy([(dst, src)], lane="d2h")
    ready, lane = log[0][1], log[1][1]
    assert log[0] == ("record", ready, "producer")  # rule 1: an event on the producer's stream ...
    assert log[1] == ("wait_event", lane, ready) and lane in d2h  # ... waited on by the lane
    assert log[2] == ("copy", lane, True)  # the copy runs on the lane, asynchronously
    assert log[3][0] == "record" and log[3][2] == lane  # completion event on the lane
    done_event = log[3][1]
    h.wait_stream(torch.device("cuda:0"))
    assert log[4] == ("wait_event", "producer", done_event)  # rule 4: consumer waits, no host sync
    assert h.done() and dst.tolist() == list(range(8))
    engine.copy([(dst, src)], lane="d2h")
    assert log[6][1] != lane  # round robin over the lane's streams
    assert ("synchronize", done_event) not in log


def test_a_gpu_entry_whose_write_failed_is_not_demoted_as_poison(open_cache):
    """The GPU write of "a" fails (its blocks hold poison) after "a" was already chosen as a victim
    and its demotion copy queued behind the write: the host tier must not commit those bytes."""
    e = DeferredCopyEngine()
    c = open_cache(cfg(gpu_blocks=2, host_blocks=4), e)
    ha = c.put("a", filled(BLOCK, 1))
    hb = c.put("b", filled(2 * BLOCK, 2))  # needs the whole GPU budget: "a" is demoted
    assert e.pending >= 3  # a's write, a's demotion copy, b's write
    e.fail_with = RuntimeError("injected")
    e.complete(1)  # a's write fails, poisoning its blocks
    e.complete()
    assert hb.wait(5) and not ha.wait(5)
    assert "host" not in where(c, "a"), "the poisoned GPU blocks were committed to the host tier"
    with pumping(e):
        got = c.get("a")
    assert got is None or raw_bytes(got) == raw_bytes(filled(BLOCK, 1)), "poison was served"
    check_quiescent(c)
