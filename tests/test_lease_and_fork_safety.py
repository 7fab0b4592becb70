"""Issue #16, items 1 and 3: a lease ends once (a second release never frees another reader's
pin), and a cache opened before fork() refuses to run in the child."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading

import pytest
import torch

from ectier import CacheConfig, HostTierConfig, TieredCache, testing
from ectier.errors import ProcessForkedError

KiB = 1024


def _cache(tmp_path, **host):
    return TieredCache(CacheConfig(namespace="test", host=HostTierConfig(
        capacity_bytes=host.get("capacity", 2 * 64 * KiB), block_bytes=64 * KiB, pin_memory=False,
        admit_wait_s=0.05)))


def test_a_lease_released_twice_never_frees_another_readers_pin(tmp_path):
    with _cache(tmp_path) as cache:
        value = torch.full((64 * KiB,), 7, dtype=torch.uint8)
        cache.put("k", value)
        a, b = cache.acquire("k"), cache.acquire("k")
        assert testing.pins(cache) == 2
        cache.release(a)
        cache.release(a)  # a no-op: the lease already ended
        assert testing.pins(cache) == 1, "the second release of A dropped B's pin"
        # B's slot must never be evicted or overwritten while B reads: churn through the arena
        for i in range(4):
            cache.put(f"x{i}", torch.full((64 * KiB,), i, dtype=torch.uint8))
        assert testing.holds(cache, "host", "k")
        assert torch.equal(cache.load(b), value)  # B's bytes are intact
        cache.release(b)
        assert testing.pins(cache) == 0
        with pytest.raises(ValueError, match="released"):
            cache.load(b)


def test_commit_or_abort_of_an_ended_lease_is_a_clear_error(tmp_path):
    with _cache(tmp_path) as cache:
        lease = cache.reserve("k", dtype="uint8", shape=(10,))
        cache.abort(lease)
        with pytest.raises(ValueError, match="already"):
            cache.commit(lease)
        with pytest.raises(ValueError, match="already"):
            cache.abort(lease)
        assert not cache.contains("k")
        testing.check_invariants(cache)


def _child_uses(cache, conn):
    try:
        cache.put("from-child", torch.ones(4))
        conn.send("no error")
    except ProcessForkedError as exc:
        conn.send(f"refused: {exc}")
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(f"other: {type(exc).__name__}: {exc}")
    finally:
        cache.close()  # only marks it closed: the parent's files stay the parent's
        conn.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_cache_used_in_a_forked_child_is_refused_and_the_parent_is_untouched(tmp_path):
    with _cache(tmp_path) as cache:
        cache.put("k", torch.arange(8))
        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_child_uses, args=(cache, child))
        p.start()
        answer = parent.recv() if parent.poll(30) else "no answer"
        p.join(30)
        assert answer.startswith("refused:") and "new TieredCache in the child" in answer, answer
        assert not cache.contains("from-child")
        assert torch.equal(cache.get("k"), torch.arange(8))  # the parent still works
        testing.check_invariants(cache)


def test_release_and_abort_in_a_forked_child_end_the_lease_without_the_parents_lock(tmp_path):
    """A forked child that gives back leases it inherited never touches the cache's lock, which a
    parent thread may have held at the fork (the child would wait on it forever): the release and
    the abort only end the lease objects; the parent's pins are untouched."""
    with _cache(tmp_path, capacity=4 * 64 * KiB) as cache:
        cache.put("a", torch.ones(100))
        lease, reservation = cache.acquire("a"), cache.reserve("r", dtype="uint8", shape=(1000,))
        stop = threading.Event()

        def busy():  # another thread in ordinary cache calls (a prefetch pool, a server thread)
            while not stop.is_set():
                cache.contains("a")
                cache.stats()

        thread = threading.Thread(target=busy, daemon=True)
        thread.start()
        hung = 0
        try:
            for _ in range(20):
                pid = os.fork()
                if pid == 0:  # the child: give both back, or hang until SIGALRM kills it
                    signal.alarm(3)
                    try:
                        cache.release(lease)
                        cache.abort(reservation)
                    finally:
                        os._exit(0)
                _, status = os.waitpid(pid, 0)
                hung += os.WIFSIGNALED(status)
        finally:
            stop.set()
            thread.join()
        assert hung == 0, f"{hung} of 20 forked children hung giving back a lease"
        assert testing.pins(cache, "host") == 1  # the parent's pin is its own
        cache.release(lease)
        cache.abort(reservation)
        testing.check_invariants(cache)


def test_load_of_a_lease_to_the_cpu_never_waits_on_the_copy_engine(tmp_path):
    """A lease loaded onto the CPU is a plain copy done before ``load`` returns — it must not wait
    on the copy engine (a deferred engine would never run it: a deadlock in the vLLM worker)."""
    engine = testing.DeferredCopyEngine()
    cfg = CacheConfig(namespace="test", host=HostTierConfig(capacity_bytes=2 * 64 * KiB, block_bytes=64 * KiB,
                                                           pin_memory=False))
    cache = testing.make_cache(cfg, copy_engine=engine)
    try:
        value = torch.arange(1000, dtype=torch.int32)
        h = cache.put("k", value)
        engine.complete()
        assert h.wait(5)
        lease = cache.acquire("k")
        before = engine.submitted
        assert torch.equal(cache.load(lease, device="cpu"), value)
        assert engine.submitted == before  # nothing was queued on the engine
        cache.release(lease)
    finally:
        engine.complete()
        cache.close()
