"""Concurrency: a randomized multi-thread stress with self-checking values, and deterministic races
staged with threading.Event (a reader pinning a host slot while a put must evict; a late demotion
racing an overwrite; an NVMe read racing a delete + rewrite)."""

from __future__ import annotations

import itertools
import random
import threading
import time

import pytest
import torch

from ectier import TieredCache
from ectier.tiers.host import HostTier
from ectier.tiers.nvme import NvmeTier

from conftest import (
    KiB,
    MiB,
    assert_same,
    check_budgets,
    check_quiescent,
    digest,
    filled,
    host_holds,
    make_config,
    nvme_holds,
)
from ectier import testing

# ============================================================================ randomized stress

N_KEYS = 8
# int64 element counts: 2 KiB, 16 KiB, 48 KiB, 100 KiB, 300 KiB (larger than the host budget)
LENGTHS = [256, 2048, 6144, 12800, 38400]
VIEWS = ["int64", "bf16", "2d-f32"]
N_THREADS = 4
N_OPS = 120


class Values:
    """Self-describing values: element i of a value is ``key << 56 | version << 24 | i`` (int64),
    so a value read back names its key and version, and any mix of two values is detected."""

    def __init__(self) -> None:
        self._versions = itertools.count(1)
        self._lock = threading.Lock()
        self.spec: dict[int, tuple[int, str, tuple[int, ...]]] = {}  # version -> (key, dtype, shape)

    def make(self, key_id: int, rng: random.Random) -> torch.Tensor:
        version = next(self._versions)
        n = rng.choice(LENGTHS)
        base = (key_id << 56) | (version << 24)
        t = torch.arange(n, dtype=torch.int64) | base
        view = rng.choice(VIEWS)
        if view == "bf16":
            t = t.view(torch.bfloat16)
        elif view == "2d-f32":
            t = t.view(torch.float32).reshape(-1, 64)
        with self._lock:
            self.spec[version] = (key_id, str(t.dtype), tuple(t.shape))
        return t

    def check(self, key_id: int, got: torch.Tensor) -> int:
        """Assert ``got`` is one complete value put for ``key_id``; return its version."""
        flat = got.reshape(-1).view(torch.uint8).view(torch.int64)
        first = int(flat[0])
        version = (first >> 24) & 0xFFFFFFFF
        with self._lock:
            spec = self.spec.get(version)
        assert spec is not None, f"key {key_id}: value of unknown version {version}"
        assert spec == (key_id, str(got.dtype), tuple(got.shape)), (spec, key_id, got.dtype, got.shape)
        expected = torch.arange(flat.numel(), dtype=torch.int64) | ((key_id << 56) | (version << 24))
        assert torch.equal(flat, expected), f"key {key_id} version {version}: torn or mixed bytes"
        return version


def key_name(i: int) -> str:
    return f"key-{i}"


@pytest.mark.parametrize("write_through", [False, True], ids=["write-back", "write-through"])
def test_threads_put_get_delete_with_evictions(tmp_path, write_through):
    cfg = make_config(tmp_path / "nvme", host_bytes=256 * KiB, block_bytes=16 * KiB, nvme_bytes=1 * MiB,
                      admit_wait_s=2.0, write_through=write_through)
    cache = TieredCache(cfg)
    values = Values()
    errors: list[BaseException] = []
    stop = threading.Event()
    start = threading.Barrier(N_THREADS + 1)

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            start.wait()
            for _ in range(N_OPS):
                k = rng.randrange(N_KEYS)
                r = rng.random()
                if r < 0.5:
                    cache.put(key_name(k), values.make(k, rng))
                elif r < 0.85:
                    got = cache.get(key_name(k))
                    if got is not None:
                        values.check(k, got)
                elif r < 0.95:
                    cache.delete(key_name(k))
                elif r < 0.98:
                    cache.contains(key_name(k))
                else:
                    cache.flush()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def monitor() -> None:
        try:
            start.wait()
            while not stop.is_set():
                check_budgets(cache)
                time.sleep(0.001)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(N_THREADS)]
    mon = threading.Thread(target=monitor)
    for t in [*threads, mon]:
        t.start()
    for t in threads:
        t.join(timeout=120)
    stop.set()
    mon.join(timeout=10)
    try:
        assert not any(t.is_alive() for t in threads), "a worker is stuck"
        if errors:
            raise errors[0]
        st = cache.stats()["tiers"]
        assert st["host"]["evictions"] > 0 and st["host"]["demotions"] > 0  # the test did evict
        # quiescent consistency
        check_quiescent(cache)
        check_budgets(cache)
        assert len(cache) == sum(cache.contains(key_name(k)) for k in range(N_KEYS))
        final = {}
        for k in range(N_KEYS):  # (a promotion may now and then evict another key: compare per key)
            present = cache.contains(key_name(k))
            got = cache.get(key_name(k))
            assert present == (got is not None), f"contains/get disagree for {key_name(k)}"
            if got is not None:
                final[k] = values.check(k, got)
        check_quiescent(cache)
    finally:
        cache.close()
    # a restart serves the same versions (never an older one)
    again = TieredCache(cfg)
    try:
        for k in range(N_KEYS):
            got = again.get(key_name(k))
            if got is not None:
                assert values.check(k, got) == final.get(k), f"{key_name(k)}: another version after restart"
        check_quiescent(again)
    finally:
        again.close()


# ============================================================================ staged races


class BlockingReads:
    """Patches HostTier.read_into so that reads from chosen threads stop before copying, until
    released; every other caller (demotions, flushes) copies normally."""

    def __init__(self, monkeypatch) -> None:
        self.entered: dict[str, threading.Event] = {}
        self.release: dict[str, threading.Event] = {}
        original = HostTier.read_into

        def read_into(tier, slot, dst):
            name = threading.current_thread().name
            if name in self.release:
                self.entered[name].set()
                assert self.release[name].wait(30), "never released"
            return original(tier, slot, dst)

        monkeypatch.setattr(HostTier, "read_into", read_into)

    def start_get(self, cache, key, name):
        self.entered[name] = threading.Event()
        self.release[name] = threading.Event()
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("value", cache.get(key)), name=name)
        t.start()
        assert self.entered[name].wait(10), "the get never reached the copy"
        return t, box


def test_pinned_lru_slot_is_skipped_by_eviction(tmp_path, monkeypatch):
    blocks = BlockingReads(monkeypatch)
    cfg = make_config(tmp_path / "nvme", host_bytes=3 * 128 * KiB, nvme_bytes=2 * MiB, admit_wait_s=5.0)
    with TieredCache(cfg) as cache:
        vals = {k: filled(128 * KiB, i) for i, k in enumerate("ABCD")}
        for k in "ABC":
            cache.put(k, vals[k])
        # the write-behind (of A, then B) pins each entry it writes: one on B would turn D's eviction to C
        assert testing.write_behind_idle(cache)
        g, box = blocks.start_get(cache, "A", "getter-A")  # A pinned mid-get
        assert cache.get("B") is not None and cache.get("C") is not None  # A is now the LRU
        t0 = time.monotonic()
        cache.put("D", vals["D"])  # must evict B (A is pinned), not wait for A
        assert time.monotonic() - t0 < 2.0
        assert host_holds(cache, "A") and not host_holds(cache, "B") and host_holds(cache, "D")
        assert nvme_holds(cache, "B")
        blocks.release["getter-A"].set()
        g.join(10)
        assert_same(box["value"], vals["A"])
        for k in "ABCD":
            assert_same(cache.get(k), vals[k])
        check_quiescent(cache)


def test_put_waits_for_the_pinned_slot_then_evicts_it(tmp_path, monkeypatch):
    blocks = BlockingReads(monkeypatch)
    cfg = make_config(tmp_path / "nvme", host_bytes=128 * KiB, nvme=False, admit_wait_s=10.0)
    with TieredCache(cfg) as cache:
        a, b = filled(128 * KiB, 1), filled(128 * KiB, 2)
        cache.put("A", a)
        g, box = blocks.start_get(cache, "A", "getter-A")
        p = threading.Thread(target=cache.put, args=("B", b))
        p.start()
        p.join(0.3)
        assert p.is_alive(), "the put did not wait for the pinned slot"
        assert host_holds(cache, "A") and not cache.contains("B")
        blocks.release["getter-A"].set()
        g.join(10)
        p.join(10)
        assert not p.is_alive()
        assert_same(box["value"], a)  # the reader got A's bytes, not B's
        assert_same(cache.get("B"), b)
        assert not cache.contains("A")
        check_quiescent(cache)


def test_put_gives_up_on_pinned_host_and_goes_to_nvme(tmp_path, monkeypatch):
    blocks = BlockingReads(monkeypatch)
    cfg = make_config(tmp_path / "nvme", host_bytes=128 * KiB, nvme_bytes=2 * MiB, admit_wait_s=0.2)
    with TieredCache(cfg) as cache:
        a, b = filled(128 * KiB, 1), filled(128 * KiB, 2)
        cache.put("A", a)
        g, box = blocks.start_get(cache, "A", "getter-A")
        cache.put("B", b)
        assert cache.stats()["tiers"]["host"]["admission_timeouts"] == 1
        assert nvme_holds(cache, "B") and host_holds(cache, "A")
        blocks.release["getter-A"].set()
        g.join(10)
        assert_same(box["value"], a)
        assert_same(cache.get("A"), a)
        assert_same(cache.get("B"), b)
        check_quiescent(cache)


def test_late_demotion_never_resurrects_old_bytes(tmp_path, monkeypatch):
    """K v1 is being demoted (its NVMe write held back) while K v2 is put: the put returns only once
    that write has landed and its record is deleted as stale (docs/reliability.md); K then reads
    v2, before and after a restart."""
    # no write-behind: it would write K v1 ahead of the eviction (a clean eviction, no late demotion)
    cfg = make_config(tmp_path / "nvme", host_bytes=2 * 128 * KiB, nvme_bytes=2 * MiB, flush_on_close=False,
                      write_behind_fraction=0.0)
    k_digest = digest("K")
    entered, release = threading.Event(), threading.Event()
    original = NvmeTier.write

    def write(tier, d, record):
        if d == k_digest and not release.is_set():
            entered.set()
            assert release.wait(30)
        return original(tier, d, record)

    monkeypatch.setattr(NvmeTier, "write", write)
    with TieredCache(cfg) as cache:
        v1, v2 = filled(128 * KiB, 1), torch.arange(1000, dtype=torch.float32)
        cache.put("K", v1)
        cache.put("X", filled(128 * KiB, 2))
        p = threading.Thread(target=cache.put, args=("Y", filled(128 * KiB, 3)))
        p.start()  # evicts K (the LRU): its demotion blocks in NvmeTier.write
        assert entered.wait(10)
        q = threading.Thread(target=cache.put, args=("K", v2))
        q.start()
        q.join(0.5)
        assert q.is_alive(), "put of K v2 returned while the demotion of v1 could still commit its record"
        release.set()
        for t in (p, q):
            t.join(10)
            assert not t.is_alive()
        assert_same(cache.get("K"), v2)
        rec = testing.tier(cache, "nvme").record(k_digest)
        assert rec is None or rec.header.dtype == "float32"
        check_quiescent(cache)
    with TieredCache(cfg) as again:  # no flush: K v2 lived only in host; v1 must not come back
        got = again.get("K")
        assert got is None or raw_equal(got, v2)


def raw_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


class _EnvProxy:
    """Wraps an lmdb.Environment so that a read transaction from one thread can be held open
    at chosen points (lmdb.Environment itself cannot be monkeypatched); ``real`` is the wrapped one."""

    def __init__(self, env, thread_name):
        self.real = env
        self._thread_name = thread_name
        self.before_begin = threading.Event()
        self.go_begin = threading.Event()
        self.begun = threading.Event()
        self.go_on = threading.Event()

    def begin(self, *args, **kwargs):
        # the first read-only transaction of the reading thread: the read's index lookup
        staged = threading.current_thread().name == self._thread_name \
            and not kwargs.get("write") and not self.go_on.is_set()
        if staged:
            self.before_begin.set()
            assert self.go_begin.wait(30)
        txn = self.real.begin(*args, **kwargs)
        if staged:
            self.begun.set()
            assert self.go_on.wait(30)
        return txn

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_nvme_read_racing_delete_and_rewrite_keeps_the_new_record(tmp_path):
    """get(K) finds K v1 on NVMe; before its read transaction starts, K is deleted; after it
    started, K v2 is written. The read sees no record (a miss is fine), but the tier must keep
    knowing about v2: K v2 is served afterwards and counted in the budget."""
    cfg = make_config(tmp_path / "nvme", host_bytes=0, nvme_bytes=2 * MiB)
    with TieredCache(cfg) as cache:
        v1, v2 = filled(64 * KiB, 1), filled(96 * KiB, 2)
        cache.put("K", v1)
        proxy = _EnvProxy(testing.lmdb_of(cache).env, "getter")
        testing.set_lmdb_env(cache, proxy)
        try:
            box = {}
            g = threading.Thread(target=lambda: box.setdefault("v", cache.get("K")), name="getter")
            g.start()
            assert proxy.before_begin.wait(10)
            assert cache.delete("K")
            proxy.go_begin.set()
            assert proxy.begun.wait(10)
            cache.put("K", v2)
            proxy.go_on.set()
            g.join(10)
            assert not g.is_alive()
        finally:
            testing.set_lmdb_env(cache, proxy.real)
        assert box["v"] is None or raw_equal(box["v"], v1) or raw_equal(box["v"], v2)
        assert cache.contains("K")
        assert_same(cache.get("K"), v2)
        assert cache.stats()["tiers"]["nvme"]["entries"] == 1
        check_quiescent(cache)
