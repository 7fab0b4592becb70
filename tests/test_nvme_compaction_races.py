"""Moves of records below the budget's end under concurrency and failure (ectier/tiers/nvme_compact.py):
a damaged record or a failing disk is not read again by every call, a record placed past the end
while a compaction runs is still moved, a churn of threads with moves keeps bytes and blocks
exact, close() during a move, and group commits that fill the LMDB map."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import random
import threading

import pytest

from ectier import TieredCache, testing, testing_internals
from ectier.config import NvmeTierConfig
from ectier.entry import EntryMeta, next_version
from ectier.tiers.nvme import NvmeTier

from conftest import KiB, MiB, assert_same, digest, filled
from nvme_helpers import io_held, overwrite_during_a_read

BLOCK = 64 * KiB


def _segment_bytes(tmp_path) -> int:
    return os.stat(tmp_path / "nvme" / "segment.0").st_size


def _past_base_record(make_cache, tmp_path, monkeypatch, *, corrupt: bool):
    """A 4 MiB budget; "a" (3.5 MiB) overwritten while a get holds its old copy, so its new copy
    stays past the budget's end (the move had no room). With ``corrupt`` a byte of the new copy's
    blocks past the base is flipped on disk before the read ends. Returns the cache."""
    capacity, entry = 4 * MiB, 3 * MiB + 512 * KiB
    cache, _ = make_cache(host_bytes=0, nvme_bytes=capacity)
    cache.put("a", filled(entry, 1))
    cache.put("b", filled(60 * KiB, 7))
    with overwrite_during_a_read(monkeypatch, cache, "a", filled(entry, 2)) as got:
        assert _segment_bytes(tmp_path) > 1.5 * capacity  # (the move had no room)
        if corrupt:
            loc = testing.record_of(cache, "a").location
            last_start, last_n = loc.extents[-1]
            fd = os.open(tmp_path / "nvme" / "segment.0", os.O_RDWR)
            try:
                off = (last_start + last_n - 1) * BLOCK
                b = os.pread(fd, 1, off)
                os.pwrite(fd, bytes([b[0] ^ 0xFF]), off)
            finally:
                os.close(fd)
    assert_same(got["a"], filled(entry, 1))
    return cache


def test_a_damaged_record_past_the_end_is_not_read_again_by_every_get(make_cache, tmp_path, monkeypatch):
    """A record past the budget's end whose bytes fail their checksum is not moved, and not looked
    at again by every later get (of any key): a get of 60 KiB reads about 60 KiB."""
    cache = _past_base_record(make_cache, tmp_path, monkeypatch, corrupt=True)
    real, read_bytes = os.preadv, []

    def preadv(fd, bufs, off, *a):
        n = real(fd, bufs, off, *a)
        read_bytes.append(n)
        return n

    with monkeypatch.context() as patched:
        patched.setattr(os, "preadv", preadv)
        for _ in range(5):
            read_bytes.clear()
            assert_same(cache.get("b"), filled(60 * KiB, 7))
            # expected: a get of a 60 KiB entry reads about 60 KiB
            assert sum(read_bytes) < 1 * MiB, f"a get of 60 KiB read {sum(read_bytes)} bytes"


def test_a_move_failing_on_io_is_not_tried_again_by_every_get(make_cache, tmp_path, monkeypatch, caplog):
    """A move that fails (EIO writing the copy below the budget's end) is not tried again by the
    next gets (for ``nvme_compact.RETRY_S``): one warning, one write error, gets read their own bytes."""
    cache = _past_base_record(make_cache, tmp_path, monkeypatch, corrupt=False)
    # the read ended: the move was done then; make it fail from a new overwrite on
    real_pwrite, failing = os.pwrite, {"on": False}

    def pwrite(fd, data, off):
        if failing["on"] and off < 4 * MiB:
            raise OSError(errno.EIO, "injected")
        return real_pwrite(fd, data, off)

    assert _segment_bytes(tmp_path) <= 4.4 * MiB
    # grow the file again with a reader holding the old copy; the move fails with EIO when it ends
    real = os.preadv
    with io_held(monkeypatch, "preadv", "R2") as (in_read, go), monkeypatch.context() as patched:
        patched.setattr(os, "pwrite", pwrite)
        reader = threading.Thread(target=lambda: cache.get("a"), name="R2", daemon=True)
        reader.start()
        assert in_read.wait(10)
        cache.put("a", filled(3 * MiB + 512 * KiB, 3))
        failing["on"] = True
        go.set()
        reader.join(10)
        errors0 = cache.stats()["tiers"]["nvme"]["write_errors"]
        read_bytes = []

        def counting(fd, bufs, off, *a):
            n = real(fd, bufs, off, *a)
            read_bytes.append(n)
            return n

        patched.setattr(os, "preadv", counting)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ectier"):
            for _ in range(5):
                assert_same(cache.get("b"), filled(60 * KiB, 7))
    warnings = [r for r in caplog.records if "moving a record below" in r.getMessage()]
    errors = cache.stats()["tiers"]["nvme"]["write_errors"] - errors0
    assert sum(read_bytes) < 1 * MiB and len(warnings) <= 1 and errors <= 1, (
        f"5 gets of 60 KiB read {sum(read_bytes)} bytes, logged {len(warnings)} warnings, counted {errors} write errors")


def _blocks_of_records(cache) -> int:
    nvme = testing.tier(cache, "nvme")
    return sum(rec.location.blocks for _, rec in nvme.records()) * BLOCK


@pytest.mark.parametrize("seed,sync,host", [(1, True, 0), (2, False, 8 * MiB)])
def test_concurrent_churn_with_compaction(make_cache, tmp_path, seed, sync, host):
    """6 threads put/get/delete 0.5-3 MiB entries over an 8 MiB budget, reads holding old copies
    so moves are done at read ends: no wrong bytes, the segment's used blocks equal the records'
    blocks, the file is back within budget, a reopen quarantines nothing."""
    capacity = 8 * MiB
    cache, cfg = make_cache(host_bytes=host, nvme_bytes=capacity, sync=sync)
    errors, written, moves = [], {}, []
    lock = threading.Lock()

    def worker(t):
        rng = random.Random(seed * 100 + t)
        try:
            for i in range(60):
                key = f"k{rng.randrange(6)}"
                r = rng.random()
                if r < 0.45:
                    val = (rng.choice([1, 2, 3]) * MiB - rng.randrange(4) * 100 * KiB, t * 1000 + i)
                    with lock:
                        written.setdefault(key, set()).add(val)
                    cache.put(key, filled(*val))
                elif r < 0.9:
                    got = cache.get(key)
                    if got is not None:
                        with lock:
                            cands = list(written.get(key, ()))
                        if not any(got.numel() == n and bool((got == filled(n, v)).all()) for n, v in cands):
                            errors.append(f"wrong bytes for {key}: {got.numel()}")
                else:
                    cache.delete(key)
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    with contextlib.ExitStack() as stack:
        stack.enter_context(testing_internals.around_nvme_move(cache, after=lambda d, c: moves.append(c)))
        check = stack.enter_context(testing.check_sync_order(cache)) if sync else None
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
    assert not errors, errors[:5]
    if check is not None:
        assert check.violations == [], check.violations[:5]
    testing.check_invariants(cache)
    nvme = testing.tier(cache, "nvme")
    sp = nvme.space()
    assert sp["segment_used_bytes"] == _blocks_of_records(cache), (sp, _blocks_of_records(cache))
    assert _segment_bytes(tmp_path) <= 1.1 * capacity, _segment_bytes(tmp_path) / capacity
    st = cache.stats()["tiers"]["nvme"]
    assert st["checksum_failures"] == 0 and st["quarantined"] == 0
    cache.close()
    with TieredCache(cfg) as again:
        st = again.stats()["tiers"]["nvme"]
        assert st["quarantined"] == 0 and st["orphans_reclaimed"] == 0
        for key in list(written):
            got = again.get(key)
            if got is not None:
                assert any(got.numel() == n and bool((got == filled(n, v)).all()) for n, v in written[key]), key
        assert again.stats()["tiers"]["nvme"]["checksum_failures"] == 0


def test_compaction_racing_close(make_cache, tmp_path, monkeypatch, caplog):
    """close() while a get holds the old copy of an overwritten entry (its move had no room): the
    get ends, its move runs into the closed store: no WARNING, no hang, a clean reopen that moves it."""
    capacity, entry = 4 * MiB, 3 * MiB + 512 * KiB
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=capacity)
    cache.put("a", filled(entry, 1))
    got = {}
    with io_held(monkeypatch, "preadv", "R") as (in_read, go), caplog.at_level(logging.WARNING, logger="ectier"):
        reader = threading.Thread(target=lambda: got.setdefault("a", cache.get("a")), name="R", daemon=True)
        reader.start()
        assert in_read.wait(10)
        cache.put("a", filled(entry, 2))
        closer = threading.Thread(target=cache.close, daemon=True)
        closer.start()
        closer.join(0.5)
        go.set()
        reader.join(10)
        closer.join(10)
        assert not reader.is_alive() and not closer.is_alive()
    warnings = [r.getMessage() for r in caplog.records if "moving a record" in r.getMessage()]
    assert warnings == [], warnings
    with TieredCache(cfg) as again:
        assert again.stats()["tiers"]["nvme"]["quarantined"] == 0
        assert_same(again.get("a"), filled(entry, 2))
        assert _segment_bytes(tmp_path) <= 1.1 * capacity


def test_a_record_placed_past_the_end_during_a_compaction_is_moved_later(tmp_path):
    """A digest noted past the end, deleted, then put past the end again by another thread while a
    compaction moves an earlier candidate: it stays noted and is moved once there is room (the
    candidates' order is a set's: a few trials, each with other keys, reach that order)."""
    def put(tier, key, nblocks, value):
        n = nblocks * BLOCK
        meta = EntryMeta("test", key, "uint8", (n,), n)
        assert tier.write(digest(key), tier.encode(meta, filled(n, value), next_version()))

    for trial in range(8):
        path = tmp_path / f"t{trial}"
        tier = NvmeTier(NvmeTierConfig(path=str(path), capacity_bytes=16 * BLOCK, sync=False))
        seg = path / "segment.0"
        try:
            put(tier, f"f{trial}", 8, 1)  # blocks 0..7
            put(tier, f"g{trial}", 4, 2)  # 8..11
            put(tier, f"d{trial}", 8, 3)  # 12..19: past the base (16); no room below: noted
            put(tier, f"x{trial}", 4, 4)  # 20..23: noted
            assert tier.delete(digest(f"d{trial}"))  # 12..19 free; d stays noted (no record)
            done = []

            def before(d):
                if d == digest(f"x{trial}") and not done:  # another thread puts d while x is moved
                    done.append(1)
                    th = threading.Thread(target=put, args=(tier, f"d{trial}", 8, 5))
                    th.start()
                    th.join(10)

            with testing_internals.around_nvme_move(tier, before=before):
                assert tier.read(digest(f"g{trial}"), "test", f"g{trial}") is not None  # its end compacts
            assert tier.delete(digest(f"f{trial}"))  # room below the base for d
            for _ in range(3):  # reads (and writes) look at the noted records again
                header, data = tier.read(digest(f"g{trial}"), "test", f"g{trial}")
            header, data = tier.read(digest(f"d{trial}"), "test", f"d{trial}")
            assert bytes(data.numpy()) == bytes(filled(8 * BLOCK, 5).numpy())
            assert os.stat(seg).st_size <= 16 * BLOCK, (
                f"trial {trial} (x moved first: {bool(done)}): the segment file stays "
                f"{os.stat(seg).st_size // BLOCK} blocks, budget 16; d's record {tier.record(digest(f'd{trial}'))}")
        finally:
            tier.close()


def test_group_commits_that_fill_the_map_grow_it_and_retry(make_cache):
    """8 threads put 150 small entries each with a tiny LMDB map: every group that found the map
    full grows it and retries; every entry is stored once, with its own bytes."""
    cache, _ = make_cache(host_bytes=0, nvme_bytes=160 * MiB, map_initial_bytes=1 * MiB, group_commit_s=0.002)
    errors = []

    def worker(t):
        try:
            for i in range(250):
                cache.put(f"t{t}-{i}" + "x" * 900, filled(700 + t, t * 1000 + i))
        except Exception as exc:  # noqa: BLE001
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors[:3]
    st = cache.stats()["tiers"]["nvme"]
    assert st["map_growths"] > 0 and st["write_errors"] == 0
    for t in range(8):
        for i in range(250):
            assert_same(cache.get(f"t{t}-{i}" + "x" * 900), filled(700 + t, t * 1000 + i))
    testing.check_invariants(cache)
    nvme = testing.tier(cache, "nvme")
    assert nvme.space()["segment_used_bytes"] == _blocks_of_records(cache)
