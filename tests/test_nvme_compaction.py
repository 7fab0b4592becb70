"""The segment file cut back to ``nvme.capacity_bytes`` once a write or a lowered budget left
records past its end: they are moved below it (ectier/tiers/nvme_compact.py), their bytes intact."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest

from ectier import TieredCache, testing

from conftest import KiB, MiB, assert_same, check_quiescent, filled
from nvme_helpers import overwrite_during_a_read


def _segment_bytes(tmp_path) -> int:
    return os.stat(tmp_path / "nvme" / "segment.0").st_size


def test_overwriting_a_large_entry_leaves_the_file_within_its_budget(make_cache, tmp_path):
    """Replacing an entry of 7/8 of the budget holds both copies until the new one commits (the
    file grows to 1.75x); once the put returns the new copy is moved down and the file cut."""
    capacity, entry = 4 * MiB, 3 * MiB + 512 * KiB
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=capacity)
    cache.put("a", filled(entry, 1))
    cache.put("a", filled(entry, 2))
    check_quiescent(cache)
    assert _segment_bytes(tmp_path) <= 1.1 * capacity
    assert_same(cache.get("a"), filled(entry, 2))
    cache.close()
    with TieredCache(cfg) as again:
        assert_same(again.get("a"), filled(entry, 2))
        assert _segment_bytes(tmp_path) <= 1.1 * capacity
        assert again.stats()["tiers"]["nvme"]["quarantined"] == 0


@pytest.mark.parametrize("seed", [1, 2])
def test_churn_of_large_entries_keeps_the_file_within_its_budget_after_every_put(make_cache, tmp_path, seed):
    """Puts and deletes of 1-4 MiB entries over a 16 MiB budget: after every call, with no write
    in flight, the file is at most 1.1x the budget, and every entry reads back."""
    capacity = 16 * MiB
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=capacity)
    rng, expected, worst = random.Random(seed), {}, 0
    for i in range(300):
        key = f"k{rng.randrange(12)}"
        if rng.random() < 0.1:
            cache.delete(key)
            expected.pop(key, None)
        else:
            expected[key] = (rng.choice([1, 2, 3, 4]) * MiB - rng.randrange(1000), i)
            cache.put(key, filled(*expected[key]))
        worst = max(worst, _segment_bytes(tmp_path))
    check_quiescent(cache)
    assert worst <= 1.1 * capacity, worst / capacity
    for key, (nbytes, value) in expected.items():
        got = cache.get(key)
        assert got is None or same(got, filled(nbytes, value)), key  # (evicted is fine, wrong bytes are not)
    assert cache.stats()["tiers"]["nvme"]["checksum_failures"] == 0


def same(a, b) -> bool:
    assert_same(a, b)
    return True


def test_a_lowered_budget_gives_the_disk_space_back_at_open(make_cache, tmp_path):
    """A store reopened with a quarter of its budget evicts its oldest records, and the newest,
    which lay at the file's end, are moved down: the file is cut to the new budget."""
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=16 * MiB)
    for i in range(14):
        cache.put(f"k{i}", filled(1 * MiB - 100, i))
    cache.close()
    small = cfg.replace(nvme=dataclasses.replace(cfg.nvme, capacity_bytes=4 * MiB))
    with TieredCache(small) as again:
        kept = [i for i in range(14) if again.contains(f"k{i}")]
        assert kept and kept == list(range(14 - len(kept), 14))  # the newest
        for i in kept:
            assert_same(again.get(f"k{i}"), filled(1 * MiB - 100, i))
        assert _segment_bytes(tmp_path) <= 1.1 * 4 * MiB
    with TieredCache(small) as third:  # and the moved records' index entries are what a reopen finds
        for i in kept:
            assert_same(third.get(f"k{i}"), filled(1 * MiB - 100, i))
        assert third.stats()["tiers"]["nvme"]["quarantined"] == 0


def test_moving_records_down_keeps_the_sync_order(make_cache, tmp_path):
    """Each move writes into free blocks only, syncs them before the index entry naming them
    commits, and frees the old blocks after it (docs/reliability.md, "Power loss")."""
    capacity = 4 * MiB
    cache, _ = make_cache(host_bytes=0, nvme_bytes=capacity, sync=True)
    with testing.check_sync_order(cache) as check:
        for value in range(1, 5):
            cache.put("a", filled(3 * MiB + 512 * KiB, value))  # each overwrite grows the file, then a move
            assert _segment_bytes(tmp_path) <= 1.1 * capacity
        cache.put("b", filled(256 * KiB, 9))
    assert check.violations == []
    assert check.syncs >= 8
    assert_same(cache.get("a"), filled(3 * MiB + 512 * KiB, 4))


def test_a_move_that_found_no_room_under_a_read_is_done_when_the_read_ends(make_cache, tmp_path, monkeypatch):
    """An overwrite while a get reads the old copy: the old blocks stay held for that read, so the
    move after the write finds no room. When the read ends the move is done, with the cache idle
    afterwards: the file is back within its budget."""
    capacity, entry = 4 * MiB, 3 * MiB + 512 * KiB
    cache, _ = make_cache(host_bytes=0, nvme_bytes=capacity)
    cache.put("a", filled(entry, 1))
    with overwrite_during_a_read(monkeypatch, cache, "a", filled(entry, 2)) as got:
        assert _segment_bytes(tmp_path) > 1.5 * capacity  # (both copies: the move had no room)
    assert_same(got["a"], filled(entry, 1))  # the read in progress got the old bytes whole
    check_quiescent(cache)
    assert _segment_bytes(tmp_path) <= 1.1 * capacity
    assert_same(cache.get("a"), filled(entry, 2))
