"""How long a caller waits on the remote tier's account: a remote hit never waits for room in a
host arena full of readers' pins, and ``close()`` does not run the remote fetches still queued.
On the in-memory store (``ectier.testing.MemoryBackend``)."""

from __future__ import annotations

import time

import torch

from ectier import testing
from ectier.errors import EctierError

KiB = 1024


def _cfg(**host):
    return {"namespace": "ns", "host": {"capacity_bytes": 256 * KiB, "block_bytes": 16 * KiB, **host},
            "remote": {"backend": "redis", "addresses": "127.0.0.1:1", "timeout_s": 1.0, "backoff_s": 0.3}}


def _publish(store, cfg, items):
    producer = testing.make_cache(cfg, remote_backend=store)
    try:
        for key, t in items.items():
            producer.put(key, t)
        assert producer.wait_remote(10)
    finally:
        producer.close()


def test_a_remote_hit_is_served_at_once_when_readers_pin_the_whole_host_arena():
    """It used to be placed as a put is: waiting ``host.admit_wait_s`` (3 s here) for room that
    only readers' pins held, on every get, before the caller got the bytes it already had."""
    store, cfg = testing.MemoryBackend(), _cfg(admit_wait_s=3.0)
    want = torch.arange(4 * KiB, dtype=torch.int32)
    _publish(store, cfg, {"r": want})
    consumer = testing.make_cache(cfg, remote_backend=store)
    try:
        consumer.put("full", torch.zeros(256 * KiB, dtype=torch.uint8))
        lease = consumer.acquire("full")  # a reader pins the whole arena
        assert lease is not None
        for _ in range(2):
            t0 = time.monotonic()
            got = consumer.get("r")
            took = time.monotonic() - t0
            assert got is not None and torch.equal(got, want)
            assert took < 1.0, f"a remote hit took {took:.2f} s with the host arena pinned full"
        consumer.release(lease)
        assert consumer.contains("full")  # the reader's entry was not moved for it
    finally:
        consumer.close()


def test_close_does_not_run_the_remote_fetches_still_queued():
    """20 prefetches of keys stored only remotely, on a store answering in 0.5 s: close() used to
    run every one queued behind the running ones (10 s here); now those not started finish False
    with ``EctierError``, unrun."""
    store, cfg = testing.MemoryBackend(), _cfg()
    items = {f"k{i}": torch.full((1000,), i, dtype=torch.int32) for i in range(20)}
    _publish(store, cfg, items)
    consumer = testing.make_cache(cfg, remote_backend=store)
    store.delay_s = 0.5
    calls_before = len(store.calls)
    handles = consumer.prefetch(list(items))
    t0 = time.monotonic()
    consumer.close()
    took = time.monotonic() - t0
    assert took < 3.0, f"close() took {took:.1f} s"
    assert all(h.done() for h in handles)
    results = [h.wait(0) for h in handles]
    unrun = [h for h, ok in zip(handles, results) if not ok]
    assert len(unrun) >= 10, results
    assert all(isinstance(h.error, EctierError) for h in unrun if h.error is not None)
    assert len(store.calls) - calls_before <= 20 - len(unrun)  # the unrun ones asked the store nothing
