"""``TieredCache.load(lease, view=True)``: a zero-copy CPU view of the host arena whose pin lives
exactly as long as the view's storage (no view outlives its pin; nothing evicts, reuses or frees
its bytes meanwhile), and the releaser that makes that pin's release safe from finalizers."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import threading

import pytest
import torch

from ectier import TieredCache
from ectier.moves.views import Releaser, pinned_view
from ectier.testing import check_invariants, pins

MiB = 1 << 20


def _cache(capacity: int = 4 * MiB) -> TieredCache:
    return TieredCache({"host": {"capacity_bytes": capacity, "block_bytes": 64 * 1024, "pin_memory": False}})


def _item(seed: int, rows: int = 64) -> torch.Tensor:  # rows x 8192 bf16: 1 MiB at 64 rows
    return torch.randn(rows, 8192, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _inside_arena(cache: TieredCache, t: torch.Tensor) -> bool:
    base = cache.host_arena.data_ptr()
    return base <= t.data_ptr() < base + cache.host_arena_bytes


def _view(cache: TieredCache, key: str) -> torch.Tensor:
    lease = cache.acquire(key)
    assert lease is not None
    try:
        return cache.load(lease, view=True)
    finally:
        cache.release(lease)


def test_a_view_is_zero_copy_equal_and_its_own_pin():
    with _cache() as c:
        x = _item(1)
        c.put("k", x)
        lease = c.acquire("k")
        v = c.load(lease, view=True)
        assert v.dtype == x.dtype and v.shape == x.shape and torch.equal(v.view(torch.int16), x.view(torch.int16))
        assert _inside_arena(c, v), "a view must not copy"
        assert pins(c) == 2  # the lease's and the view's
        c.release(lease)
        assert pins(c) == 1
        del v
        gc.collect()
        assert pins(c) == 0
        check_invariants(c)


def test_a_copy_is_still_the_default():
    with _cache() as c:
        c.put("k", _item(1))
        lease = c.acquire("k")
        t = c.load(lease)
        c.release(lease)
        assert not _inside_arena(c, t) and pins(c) == 0


def test_a_view_outlives_release_overwrite_delete_and_eviction_pressure():
    with _cache(4 * MiB) as c:
        x = _item(1)
        c.put("k", x)
        v = _view(c, "k")  # lease already released
        c.put("k", _item(2))  # a new version: other bytes
        c.delete("k")
        for i in range(8):  # twice the arena: every unpinned entry gets evicted
            c.put(f"fill-{i}", _item(10 + i))
        assert torch.equal(v.view(torch.int16), x.view(torch.int16)), "a live view's bytes were reused"
        # the view's bytes still count against the budget
        assert c.stats()["tiers"]["host"]["used_bytes"] == 4 * MiB
        del v
        gc.collect()
        assert pins(c) == 0
        assert c.stats()["tiers"]["host"]["used_bytes"] == 3 * MiB  # the deleted entry's blocks freed
        check_invariants(c)


def test_a_slice_keeps_the_pin_after_the_view_itself_is_gone():
    with _cache() as c:
        x = _item(1)
        c.put("k", x)
        part = _view(c, "k")[3:5].reshape(-1)
        gc.collect()
        assert pins(c) == 1
        c.delete("k")
        for i in range(8):
            c.put(f"fill-{i}", _item(10 + i))
        assert torch.equal(part.view(torch.int16), x[3:5].reshape(-1).view(torch.int16))
        del part
        gc.collect()
        assert pins(c) == 0


def test_live_views_stay_readable_after_close():
    c = _cache()
    x = _item(1)
    c.put("k", x)
    v = _view(c, "k")
    c.close()
    assert torch.equal(v.view(torch.int16), x.view(torch.int16))
    del v  # its release after close is harmless
    gc.collect()


def test_a_view_of_a_zero_size_entry():
    with _cache() as c:
        c.put("z", torch.empty(0, 8192, dtype=torch.bfloat16))
        v = _view(c, "z")
        assert v.shape == (0, 8192) and pins(c) == 0


def test_a_released_lease_cannot_be_viewed():
    with _cache() as c:
        c.put("k", _item(1))
        lease = c.acquire("k")
        c.release(lease)
        with pytest.raises(ValueError, match="released"):
            c.load(lease, view=True)


def _child_reads_and_drops(v: torch.Tensor, expected: bytes, conn) -> None:
    try:
        ok = bytes(v.reshape(-1).view(torch.uint8)[:4096].tolist()) == expected  # no intra-op threads
        del v
        gc.collect()  # a release in the child: must do nothing (and not deadlock)
        conn.send(ok)
    finally:
        conn.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_may_read_and_drop_a_view_without_touching_the_parent():
    with _cache() as c:
        x = _item(1)
        c.put("k", x)
        v = _view(c, "k")
        ctx = mp.get_context("fork")
        parent, child = ctx.Pipe()
        head = bytes(x.reshape(-1).view(torch.uint8)[:4096].tolist())
        p = ctx.Process(target=_child_reads_and_drops, args=(v, head, child))
        p.start()
        answer = parent.recv() if parent.poll(60) else "no answer"
        p.join(60)
        assert answer is True, answer
        assert p.exitcode == 0
        assert pins(c) == 1  # the parent's pin is the parent's
        del v
        gc.collect()
        assert pins(c) == 0


# ------------------------------------------------------------------------- the building blocks


def test_release_runs_once_when_the_last_view_dies():
    buf = torch.arange(256, dtype=torch.uint8)
    calls = []
    t = pinned_view(buf, 16, 32, torch.int16, (4, 4), lambda: calls.append(1))
    a, b = t[1], t.reshape(-1).view(torch.uint8)[3:]
    del t
    gc.collect()
    assert calls == []
    del a
    gc.collect()
    assert calls == []
    assert b[0].item() == 16 + 3
    del b
    gc.collect()
    assert calls == [1]


def test_pinned_view_refuses_bad_ranges_without_releasing():
    buf = torch.zeros(64, dtype=torch.uint8)
    calls = []
    with pytest.raises(ValueError, match="outside"):
        pinned_view(buf, 60, 8, torch.uint8, (8,), lambda: calls.append(1))
    with pytest.raises(ValueError, match="not"):
        pinned_view(buf, 0, 8, torch.int16, (8,), lambda: calls.append(1))
    assert calls == []


def test_the_releaser_never_blocks_on_a_held_lock():
    inner = threading.Lock()
    lock = threading.Condition(inner)
    r = Releaser(lock)
    done = threading.Event()
    with lock:  # this thread holds it, as a finalizer run by a GC inside the cache would
        r.call(done.set)
        assert not done.is_set()
    assert done.wait(10), "a deferred release never ran"
    ran = []
    r.call(lambda: ran.append(inner.locked()))  # free lock: run at once, with it held
    assert ran == [True]


def test_an_nvme_hit_acquired_is_decoded_straight_into_its_host_slot(tmp_path, monkeypatch):
    """issue #12 item 2: the record is read into the host slot it is promoted into (no
    intermediate tensor), and the lease's view is those very bytes."""
    from ectier.testing import tier, where

    cfg = {"host": {"capacity_bytes": 2 * MiB, "block_bytes": 64 * 1024, "pin_memory": False},
           "nvme": {"path": str(tmp_path / "nv"), "capacity_bytes": 64 * MiB, "flush_on_close": False}}
    with TieredCache(cfg) as c:
        items = {f"k{i}": _item(i) for i in range(4)}
        for k, x in items.items():
            c.put(k, x)
        key = next(k for k in items if where(c, k) == {"nvme"})
        nvme = tier(c, "nvme")
        outs = []
        real_read = type(nvme).read

        def spy(self, digest, namespace, k, *, out=None):
            outs.append(out)
            return real_read(self, digest, namespace, k, out=out)

        monkeypatch.setattr(type(nvme), "read", spy)
        v = _view(c, key)
        assert torch.equal(v.view(torch.int16), items[key].view(torch.int16))
        assert len(outs) == 1 and outs[0] is not None, "an NVMe hit was decoded into a fresh tensor"
        assert _inside_arena(c, outs[0]) and outs[0].data_ptr() == v.data_ptr()
        assert "host" in where(c, key)
        st = c.stats()["tiers"]
        assert st["nvme"]["hits"] == 1 and st["host"]["promotions"] == 1
        del v
        gc.collect()
        assert pins(c) == 0
        check_invariants(c)
