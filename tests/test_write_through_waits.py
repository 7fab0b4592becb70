"""A write-through that does not land waits for the write-throughs of newer versions of its key
(``NvmeMoves._end_write_through``): every version registered as "a write-through follows" at a
host commit must end that wait, or the older put never returns. Each test here stages one path
from a host commit to its write-through and checks that the put returns.
"""

from __future__ import annotations

import dataclasses

import torch

from ectier import CacheConfig, testing

from staged_threads import join, start

KiB = 1024


def _cfg(tmp_path) -> CacheConfig:
    return CacheConfig.from_dict({
        "namespace": "qwen", "host": {"capacity_bytes": "1MiB", "block_bytes": "64KiB", "pin_memory": False},
        "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": "4MiB", "sync": False, "write_through": True},
        "remote": {"timeout_s": 10.0, "backoff_s": 0.3}})


def _t(seed: int) -> torch.Tensor:
    return torch.full((4 * KiB,), seed, dtype=torch.uint8)


def test_a_put_superseded_by_a_fetched_version_returns(tmp_path):
    """Node B reserves ``k`` (the daemon's two-phase put: its version is taken now); node A puts
    ``k`` later (a newer version) and writes it to the store; B's get fetches it into B's host
    tier. B's commit is then superseded, and its write-through waits for the newer versions'
    write-throughs — the fetched entry was registered as one though nothing writes it through,
    so B's commit waited forever (and every fetched key stayed registered: a leak)."""
    be = testing.MemoryBackend()
    a = testing.make_cache(_cfg(tmp_path / "a"), remote_backend=be)
    b = testing.make_cache(_cfg(tmp_path / "b"), remote_backend=be)
    try:
        lease = b.reserve("k", dtype="uint8", shape=(4 * KiB,))
        a.put("k", _t(2))
        assert testing.drain(a)
        got = b.get("k")  # fetched from the store, placed in B's host tier
        assert got is not None and torch.equal(got, _t(2))
        t, box = start(b.commit, lease)
        join(t, box, timeout_s=10)  # (stuck before the fix)
        assert torch.equal(b.get("k"), _t(2))
        testing.check_invariants(b)
    finally:
        a.close()
        b.close()


def test_a_fetched_entry_leaves_no_write_through_registered(tmp_path):
    """A remote fetch placed in the host tier is not written through: nothing may stay registered
    as a write-through under way for its key (one per fetched key, forever, before the fix)."""
    be = testing.MemoryBackend()
    a = testing.make_cache(_cfg(tmp_path / "a"), remote_backend=be)
    b = testing.make_cache(_cfg(tmp_path / "b"), remote_backend=be)
    try:
        a.put("k", _t(3))
        assert testing.drain(a)
        assert torch.equal(b.get("k"), _t(3))
        assert testing.where(b, "k") == {"host"}
        testing.check_invariants(b)
    finally:
        a.close()
        b.close()
