"""The remote tier keeps one key's writes and deletes in order (ectier/moves/remote.py, Ordering):
a delete or a newer put made while an older write runs wins on every node; a put that is not
written removes the older object; a fetch placed while a delete ran is taken out again; a version
fetched from a node whose clock runs ahead never beats a later put made here.

Two caches on one ``ectier.testing.MemoryBackend`` stand for two nodes on one store; the store's
calls are held at a gate so that each race happens every time.
"""

from __future__ import annotations

import threading

import pytest
import torch

from ectier import CacheConfig, testing

KiB = 1024


def _cfg(**remote):
    return CacheConfig.from_dict({
        "namespace": "qwen", "host": {"capacity_bytes": "4MiB", "block_bytes": "64KiB", "pin_memory": False},
        "remote": {"timeout_s": 10.0, "backoff_s": 0.3, **remote}})


def _t(seed, rows=64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 512, generator=g).to(torch.bfloat16)


def _same(a, b):
    return a is not None and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


class Gate:
    """Holds the first ``n`` calls of a store method until :meth:`open`; ``entered`` counts them."""

    def __init__(self, be, method: str, n: int = 1, *, after: bool = False) -> None:
        self.opened, self.entered, self.n, self._lock = threading.Event(), threading.Semaphore(0), n, threading.Lock()
        inner = getattr(be, method)

        def held(*a, **kw):
            with self._lock:
                hold, self.n = self.n > 0, self.n - 1
            if hold and not after:
                self.entered.release()
                assert self.opened.wait(10), "gate never opened"
            out = inner(*a, **kw)
            if hold and after:  # the call is done (a get has its bytes); its caller waits here
                self.entered.release()
                assert self.opened.wait(10), "gate never opened"
            return out

        setattr(be, method, held)

    def wait_entered(self) -> None:
        assert self.entered.acquire(timeout=10), "no call reached the gate"

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def nodes():
    be = testing.MemoryBackend()
    made = []

    def make(cfg=None):
        c = testing.make_cache(cfg or _cfg(), remote_backend=be)
        made.append(c)
        return c

    yield be, make
    for c in made:
        c.close()


def test_a_delete_while_the_write_runs_leaves_the_key_absent_everywhere(nodes):
    be, make = nodes
    producer = make()
    gate = Gate(be, "put")
    producer.put("k", _t(1))
    gate.wait_entered()  # the write-through is inside the store's put
    assert producer.delete("k")
    gate.open()
    assert testing.drain(producer)
    assert not be.objects
    assert make().get("k") is None and producer.get("k") is None


def test_two_puts_of_one_key_reach_the_store_in_their_order(nodes):
    be, make = nodes
    producer = make()
    gate = Gate(be, "put")
    old, new = _t(2), _t(3, rows=8)
    producer.put("k", old)
    gate.wait_entered()  # the older write is held in the store's put ...
    producer.put("k", new)  # ... while the newer one is asked for
    gate.open()
    assert testing.drain(producer)
    assert _same(make().get("k"), new)


def test_a_newer_put_too_large_for_the_store_removes_the_older_object(nodes):
    be, make = nodes
    producer = make(_cfg(max_entry_bytes=256 * KiB))
    producer.put("k", _t(4))  # 64 KiB: written
    assert testing.drain(producer) and be.objects
    producer.put("k", _t(5, rows=512))  # 512 KiB: not written through
    assert testing.drain(producer)
    assert producer.stats()["tiers"]["remote"]["skipped_too_large"] == 1
    assert not be.objects
    assert make().get("k") is None  # never the older bytes


def test_a_fetch_placed_while_a_delete_ran_is_taken_out_again(nodes):
    be, make = nodes
    producer, consumer = make(), make()
    producer.put("k", _t(6))
    assert testing.drain(producer)
    gate = Gate(be, "get", after=True)
    got = []
    reader = threading.Thread(target=lambda: got.append(consumer.get("k")))
    reader.start()
    gate.wait_entered()  # the fetch has the bytes and is about to place them locally
    assert consumer.delete("k") is False  # (not stored locally yet)
    gate.open()
    reader.join(10)
    assert _same(got[0], _t(6))  # the get that raced the delete may return the bytes ...
    assert consumer.get("k") is None  # ... but the key is gone from this node afterwards
    assert not testing.where(consumer, "k")
    testing.check_invariants(consumer)


def test_a_fetched_version_from_a_clock_ahead_never_beats_a_later_put_here(nodes):
    be, make = nodes
    producer, consumer = make(), make()
    with testing.versions_from_another_clock(30.0):  # the producer's node runs 30 s ahead
        producer.put("k", _t(7))
    assert testing.drain(producer)
    assert _same(consumer.get("k"), _t(7))  # fetched: a version 30 s in this node's future
    h = consumer.put("k", _t(8))
    assert h.wait()
    assert _same(consumer.get("k"), _t(8))
    assert testing.drain(consumer)
    assert _same(make().get("k"), _t(8))
