"""The remote tier keeps one key's writes and deletes in order (ectier/moves/remote.py, Ordering):
a delete or a newer put made while an older write runs wins on every node; a put that is not
written removes the older object; a fetch placed while a delete ran is taken out again; a version
fetched from a node whose clock runs ahead never beats a later put made here.

Two caches on one ``ectier.testing.MemoryBackend`` stand for two nodes on one store; the store's
calls are held at a gate so that each race happens every time.
"""

from __future__ import annotations

import dataclasses
import threading
import time

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
    deleted = []
    deleting = threading.Thread(target=lambda: deleted.append(producer.delete("k")))
    deleting.start()  # its store call waits for the write's
    gate.open()
    deleting.join(10)
    assert deleted == [True]
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


def _fill(cache, lease, tensor):
    """Write ``tensor``'s bytes into a reservation through the public host arena."""
    flat, off = tensor.contiguous().view(torch.uint8).reshape(-1), 0
    for start, length in lease.extents:
        cache.host_arena[start:start + length].copy_(flat[off:off + length])
        off += length


def test_a_get_during_a_delete_never_brings_the_key_back(nodes):
    be, make = nodes
    producer, consumer = make(), make()
    producer.put("k", _t(10))
    assert testing.drain(producer)
    gate = Gate(be, "delete")
    deleting = threading.Thread(target=lambda: consumer.delete("k"))
    deleting.start()
    gate.wait_entered()  # forgotten locally; the store still holds the object
    consumer.get("k")  # may fetch the object the delete has not removed yet ...
    gate.open()
    deleting.join(10)
    assert consumer.get("k") is None and not testing.where(consumer, "k")  # ... never placed for good
    testing.check_invariants(consumer)


def test_a_put_made_while_a_delete_runs_is_what_the_store_keeps(nodes):
    be, make = nodes
    producer = make()
    producer.put("k", _t(11))
    assert testing.drain(producer)
    gate = Gate(be, "delete")
    deleting = threading.Thread(target=lambda: producer.delete("k"))
    deleting.start()
    gate.wait_entered()
    producer.put("k", _t(12))  # its write-through runs after the delete's store call
    gate.open()
    deleting.join(10)
    assert testing.drain(producer)
    assert _same(make().get("k"), _t(12))


def test_a_put_evicted_before_its_write_through_ran_leaves_no_older_object(nodes):
    be, make = nodes
    producer = make()
    producer.put("k", _t(13))
    assert testing.drain(producer)
    gate = Gate(be, "put", n=2)
    producer.put("a", _t(14))
    producer.put("b", _t(15))
    gate.wait_entered()
    gate.wait_entered()  # both store threads busy
    producer.put("k", _t(16))  # its write-through waits ...
    for i in range(80):  # ... while 5 MiB of puts evict it from the 4 MiB host tier (no NVMe)
        producer.put(f"f{i}", _t(100 + i))
    assert not testing.where(producer, "k")
    gate.open()
    assert testing.drain(producer, 60)
    got = make().get("k")
    assert not _same(got, _t(13))  # never the older bytes (the newer were not written: a miss)


def test_an_older_put_committed_after_a_newer_one_does_not_replace_its_write(nodes):
    be, make = nodes
    cache = make()
    cache.put("k", _t(17))
    assert testing.drain(cache)
    gate = Gate(be, "put")
    cache.put("k", _t(18))
    gate.wait_entered()  # a write of the key is running
    a, b = _t(19), _t(20)
    older = cache.reserve("k", dtype="bfloat16", shape=tuple(a.shape))
    newer = cache.reserve("k", dtype="bfloat16", shape=tuple(b.shape))
    _fill(cache, older, a)
    _fill(cache, newer, b)
    cache.commit(newer)
    cache.commit(older)  # superseded: it stands (no error) but must not displace the newer write
    gate.open()
    assert testing.drain(cache)
    assert _same(cache.get("k"), b) and _same(make().get("k"), b)


def test_puts_skipped_for_the_backlog_queue_nothing_more(nodes):
    from ectier.moves.remote import MAX_BACKLOG

    be, make = nodes
    big_host = _cfg().replace(host=dataclasses.replace(_cfg().host, capacity_bytes=256 << 20))  # nothing evicted
    cache = make(big_host)
    gate = Gate(be, "put", n=2)
    cache.put("a", _t(21, rows=1))
    cache.put("b", _t(22, rows=1))
    gate.wait_entered()
    gate.wait_entered()
    for i in range(4 * MAX_BACKLOG):
        cache.put(f"f{i}", _t(i, rows=1))
    skipped = cache.stats()["tiers"]["remote"]["skipped_backlog"]
    assert skipped >= 2 * MAX_BACKLOG
    gate.open()
    assert testing.drain(cache, 60)
    assert be.calls.count("put") + be.calls.count("delete") <= MAX_BACKLOG + 4  # bounded work, not one call per skip


def test_a_delete_that_waited_out_its_turn_still_keeps_fetches_from_bringing_the_key_back(nodes):
    be, make = nodes
    cache = make(_cfg(timeout_s=0.3))
    cache.put("k", _t(30))
    assert testing.drain(cache)  # the store holds the old object
    gate = Gate(be, "put")
    cache.put("k", _t(31))
    gate.wait_entered()  # the newer write is held: the delete below queues behind it ...
    assert cache.delete("k")  # ... and returns after its bounded wait, its store call not run yet
    cache.get("k")  # a miss here fetches the old object: served maybe, never kept
    assert not testing.where(cache, "k")
    gate.open()
    assert testing.drain(cache)
    assert cache.get("k") is None and make().get("k") is None and not be.objects


def test_a_delete_asked_while_a_write_is_queued_replaces_it(nodes):
    be, make = nodes
    cache = make()
    gate = Gate(be, "put")
    cache.put("k", _t(40))
    gate.wait_entered()  # the first write runs (held) ...
    cache.put("k", _t(41))  # ... a second is queued behind it ...
    deleting = threading.Thread(target=lambda: cache.delete("k"))
    started = time.monotonic()
    deleting.start()  # ... and the delete takes its place
    time.sleep(0.2)
    gate.open()
    deleting.join(30)
    assert time.monotonic() - started < 8  # done when its call ran, not after its 21 s bound
    assert testing.drain(cache)
    assert not be.objects and make().get("k") is None
    cache.put("k", _t(42))  # the key is not left marked as being deleted: a later put is served elsewhere
    assert testing.drain(cache)
    other = make()
    assert _same(other.get("k"), _t(42)) and testing.where(other, "k")
