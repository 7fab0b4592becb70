"""The public API's contract at its edges: a closed cache, bad arguments, ``get(out=)`` of another
shape, a second cache on one store, what ``stats()["entries"]`` counts.

Each test pins a promise of the docstrings (and docs/reliability.md, "Bad input"): a typed
``EctierError`` whose message names the argument, and nothing stored changes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ectier
from ectier import (EctierError, InvalidArgumentError, InvalidLeaseError, InvalidTensorError, StoreLockedError,
                    TieredCache)
from ectier import testing

from conftest import MiB, assert_same, check_quiescent, filled, make_config

OPERATIONS_MD = Path(__file__).resolve().parents[1] / "docs" / "operations.md"

# ============================================================================ after close


def _closed_calls(cache: TieredCache, read_lease, write_lease):
    return {
        "stats": cache.stats, "quarantined": cache.quarantined, "flush": cache.flush,
        "acquire": lambda: cache.acquire("a"), "load": lambda: cache.load(read_lease),
        "load(view)": lambda: cache.load(read_lease, view=True), "host_arena": lambda: cache.host_arena,
        "delete": lambda: cache.delete("a"), "reserve": lambda: cache.reserve("b", dtype="uint8", shape=[4]),
        "commit": lambda: cache.commit(write_lease), "len": lambda: len(cache),
        "get": lambda: cache.get("a"), "put": lambda: cache.put("c", torch.ones(2)),
        "contains": lambda: cache.contains("a"), "prefetch": lambda: cache.prefetch(["a"]),
    }


@pytest.mark.parametrize("nvme", [True, False], ids=["host+nvme", "host-only"])
def test_every_call_after_close_raises_cache_is_closed(tmp_path, nvme):
    """Regression: stats() after close raised AttributeError (NVMe tier) or returned stale
    figures (host only); load, host_arena, len and commit still ran on the freed arena."""
    cache = TieredCache(make_config(tmp_path / "nvme", nvme=nvme))
    cache.put("a", torch.arange(8, dtype=torch.float32))
    read_lease = cache.acquire("a")
    write_lease = cache.reserve("w", dtype="uint8", shape=[16])
    other = cache.reserve("x", dtype="uint8", shape=[16])
    cache.close()
    cache.close()  # idempotent
    for name, call in _closed_calls(cache, read_lease, write_lease).items():
        with pytest.raises(EctierError, match="cache is closed"):
            call()
    cache.release(read_lease)  # ending a lease after close is a no-op, no error
    cache.abort(other)
    cache.close()
    if nvme:
        with TieredCache(make_config(tmp_path / "nvme")) as again:  # nothing lost by the refused calls
            assert_same(again.get("a"), torch.arange(8, dtype=torch.float32))
            assert not again.contains("w") and not again.contains("c")


# ============================================================================ bad arguments


def test_bad_arguments_raise_invalid_argument_error_naming_them(tmp_path):
    """Regression: a negative cost_s, a lease ended twice and a load of a released lease were plain
    ValueErrors; they are InvalidArgumentError now (an EctierError and still a ValueError)."""
    assert issubclass(InvalidArgumentError, EctierError) and issubclass(InvalidArgumentError, ValueError)
    assert ectier.InvalidArgumentError is ectier.errors.InvalidArgumentError
    with TieredCache(make_config(tmp_path / "nvme")) as cache:
        cache.put("a", torch.ones(4))
        before = testing.versions(cache)
        for cost in (-1, -1e-9, float("nan"), float("inf")):
            with pytest.raises(InvalidArgumentError, match="cost_s"):
                cache.put("a", torch.zeros(4), cost_s=cost)
        for first, second in (("commit", "commit"), ("abort", "abort"), ("commit", "abort"), ("abort", "commit")):
            lease = cache.reserve("a", dtype="uint8", shape=[8])
            getattr(cache, first)(lease)
            before = testing.versions(cache)
            with pytest.raises(InvalidArgumentError, match=f"{second}: the lease"):
                getattr(cache, second)(lease)
            assert testing.versions(cache) == before
        cache.put("b", torch.full((4,), 2.0))
        lease = cache.acquire("b")
        cache.release(lease)
        for view in (False, True):
            with pytest.raises(InvalidArgumentError, match="lease: already released"):
                cache.load(lease, view=view)
        assert_same(cache.get("b"), torch.full((4,), 2.0))
        check_quiescent(cache)


def test_a_wrong_lease_object_is_an_invalid_lease_error_that_is_also_a_type_error(tmp_path):
    """Regression: commit/abort of a non-WriteLease raised a plain TypeError, release/load of a
    non-ReadLease an AttributeError; and release() of a WriteLease ended the reservation and raised
    a ValueError from the arena ("unpin: slot is not pinned"; its commit then failed). Now an
    InvalidLeaseError naming ``lease`` (still a TypeError), and the leases given stay usable."""
    assert issubclass(InvalidLeaseError, InvalidArgumentError) and issubclass(InvalidLeaseError, TypeError)
    assert ectier.InvalidLeaseError is ectier.errors.InvalidLeaseError and "InvalidLeaseError" in ectier.__all__
    with TieredCache(make_config(tmp_path / "nvme")) as cache:
        cache.put("r", torch.full((4,), 3.0))
        read = cache.acquire("r")
        write = cache.reserve("w", dtype="uint8", shape=[8])
        before = testing.versions(cache)
        calls = [(op, bad) for op in ("commit", "abort") for bad in (object(), None, read)]
        calls += [(op, bad) for op in ("release", "load") for bad in (object(), None, write)]
        for op, bad in calls:
            with pytest.raises(InvalidLeaseError, match=r"^lease: expected a (Write|Read)Lease") as info:
                getattr(cache, op)(bad)
            assert isinstance(info.value, TypeError) and isinstance(info.value, EctierError), (op, bad)
            assert type(bad).__name__ in str(info.value), (op, str(info.value))
            assert testing.versions(cache) == before, (op, bad)
        assert_same(cache.load(read), torch.full((4,), 3.0))  # neither lease was ended by the bad calls
        cache.release(read)
        cache.commit(write)
        assert cache.contains("w")
        check_quiescent(cache)


def test_a_lease_of_another_cache_is_refused_and_changes_neither_cache(tmp_path):
    """Regression: a lease of cache B given to cache A was taken as A's own: A.load read A's bytes
    at B's slot, A.commit of B's reservation lost the entry and broke A's accounting (a later put
    raised "double free"), A.release / A.abort leaked B's pin / reservation."""
    with TieredCache(make_config(tmp_path / "a")) as a, TieredCache(make_config(tmp_path / "b")) as b:
        a.put("ka", torch.full((4,), 1.0))
        b.put("kb", torch.full((4,), 2.0))
        read, write = b.acquire("kb"), b.reserve("new", dtype="float32", shape=[4])
        before_a, before_b = testing.versions(a), testing.versions(b)
        for op, lease in (("load", read), ("release", read), ("commit", write), ("abort", write)):
            with pytest.raises(InvalidLeaseError, match=r"^lease: a (Read|Write)Lease of another cache") as info:
                getattr(a, op)(lease)
            assert isinstance(info.value, TypeError), op
            assert testing.versions(a) == before_a and testing.versions(b) == before_b, op
        assert_same(b.load(read), torch.full((4,), 2.0))  # B's leases are still B's, still held
        b.release(read)
        b.commit(write)
        assert b.contains("new") and not a.contains("new")
        for i in range(6):  # A's arena is intact: puts that fill it (1 MiB) still work
            a.put(f"fill{i}", torch.full((1 << 15,), float(i)))
        assert all(a.contains(f"fill{i}") for i in range(6))
        assert_same(a.get("ka"), torch.full((4,), 1.0))
        check_quiescent(a)
        check_quiescent(b)


def test_a_copied_lease_is_the_same_lease_and_ends_once(tmp_path):
    """Regression: copy.copy(lease) made a second lease over the same slot; its commit or release
    after the original's raised a ValueError from the arena ("slot is not pinned")."""
    import copy
    import pickle

    with TieredCache(make_config(tmp_path / "nvme")) as cache:
        cache.put("r", torch.full((4,), 3.0))
        read, write = cache.acquire("r"), cache.reserve("w", dtype="uint8", shape=[8])
        assert copy.copy(read) is read and copy.deepcopy(write) is write
        cache.commit(write)
        with pytest.raises(InvalidArgumentError, match="already committed"):
            cache.commit(copy.copy(write))
        cache.release(read)
        cache.release(copy.deepcopy(read))  # a second release: a no-op, as documented
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(read)
        assert_same(cache.get("r"), torch.full((4,), 3.0))
        assert cache.contains("w")
        check_quiescent(cache)


# ============================================================================ get(out=)

SHAPE = (64, 1024)


def _where_all(cache: TieredCache) -> dict[str, set[str]]:
    return {k: testing.where(cache, k) for k in ("T", "U")}


@pytest.mark.parametrize("layout", ["host", "nvme-only", "nvme-under-host"])
@pytest.mark.parametrize("bad_shape", [(65536,), (32, 2048), (1024, 64)])
def test_get_out_of_another_shape_raises_and_changes_nothing(tmp_path, layout, bad_shape):
    """Regression: an out= of another shape with as many bytes was filled and a reshaped view of
    it returned, although the docstring says another shape raises. It raises InvalidTensorError
    naming out and both shapes, before any read: out untouched, nothing promoted or changed."""
    host_bytes = {"host": 4 * MiB, "nvme-only": 0, "nvme-under-host": 1 * MiB}[layout]
    with TieredCache(make_config(tmp_path / "nvme", host_bytes=host_bytes, nvme_bytes=8 * MiB)) as cache:
        t = filled(2 * 65536, 7).view(torch.bfloat16).view(SHAPE)
        u = filled(65536, 3).view(SHAPE)  # uint8: NVMe reads flat byte entries straight into out=
        cache.put("T", t)
        cache.put("U", u)
        if layout == "nvme-under-host":
            cache.flush()
            for k in ("T", "U"):
                assert testing.drop_copy(cache, "host", k)
        before, where = testing.versions(cache), _where_all(cache)
        for key, dtype in (("T", torch.bfloat16), ("U", torch.uint8)):
            out = torch.zeros(bad_shape, dtype=dtype)
            with pytest.raises(InvalidTensorError) as info:
                cache.get(key, out=out)
            text = str(info.value)
            assert "out" in text and str(SHAPE) in text and str(bad_shape) in text, text
            assert bool((out.view(torch.uint8) == 0).all()), "out was written into"
        assert testing.versions(cache) == before and _where_all(cache) == where
        good = torch.zeros(SHAPE, dtype=torch.bfloat16)
        assert cache.get("T", out=good) is good
        assert_same(good, t)
        assert_same(cache.get("U"), u)
        check_quiescent(cache)


# ============================================================================ one store, two caches


def test_a_second_cache_on_a_store_says_it_is_this_process(tmp_path):
    """Regression: the second TieredCache on one nvme.path of a process was told the store is
    "in use by another process"."""
    cfg = make_config(tmp_path / "nvme")
    with TieredCache(cfg) as first:
        first.put("k", torch.ones(2))
        with pytest.raises(StoreLockedError, match="in use by another TieredCache in this process"):
            TieredCache(cfg)
        assert_same(first.get("k"), torch.ones(2))
    with TieredCache(cfg) as again:  # the lock went with the first cache's close
        assert_same(again.get("k"), torch.ones(2))


# ============================================================================ stats()["entries"]


def test_stats_entries_count_every_namespace_of_the_store_as_documented(tmp_path):
    """stats()["entries"] is store-wide while contains() is per namespace: the docstring and
    docs/operations.md say so (the figure's meaning did not change)."""
    with TieredCache(make_config(tmp_path / "nvme", namespace="a")) as cache:
        cache.put("k", torch.ones(2))
        cache.put("k", torch.ones(2), namespace="b")
        cache.put("j", torch.ones(2), namespace="b")
        assert cache.contains("k") and not cache.contains("j")
        s = cache.stats()
        assert s["namespace"] == "a" and s["entries"] == 3 and s["tiers"]["host"]["entries"] == 3
    assert "every namespace" in TieredCache.stats.__doc__
    row = next(line for line in OPERATIONS_MD.read_text().splitlines() if line.startswith("| `entries` | keys stored"))
    assert "every namespace" in row, row
