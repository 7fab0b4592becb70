"""Tests for ectier.arena.BlockAllocator.

The stateful test drives random alloc / free / bad-free sequences and checks the allocator against
a plain reference model: the *set* of free block numbers plus the blocks each live allocation owns.
Expectations about runs (best fit, fewest extents) are computed from that set, never from the
allocator's own run bookkeeping.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from ectier.arena import BlockAllocator


# ----------------------------------------------------------------------------- model helpers


def runs_of(blocks: set[int]) -> list[tuple[int, int]]:
    """Maximal runs ``(start, length)`` of a set of block numbers, sorted by start."""
    runs: list[tuple[int, int]] = []
    for b in sorted(blocks):
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def blocks_of(extents) -> list[int]:
    return [b for start, count in extents for b in range(start, start + count)]


def snapshot(a: BlockAllocator):
    return (a.free_runs(), a.free_blocks, a.used_blocks)


# ------------------------------------------------------------------------------ unit tests


def test_fresh_allocator_is_one_free_run():
    a = BlockAllocator(10)
    assert a.free_runs() == [(0, 10)]
    assert a.free_blocks == 10
    assert a.used_blocks == 0


def test_empty_allocator():
    a = BlockAllocator(0)
    assert a.free_runs() == []
    assert a.alloc(0) == []
    assert a.alloc(1) is None
    assert a.free_runs() == []


def test_negative_nblocks_raises():
    with pytest.raises(ValueError, match="nblocks"):
        BlockAllocator(-1)


def test_alloc_zero_and_negative():
    a = BlockAllocator(4)
    assert a.alloc(0) == []
    assert a.free_blocks == 4
    with pytest.raises(ValueError, match="count"):
        a.alloc(-1)
    assert snapshot(a) == ([(0, 4)], 4, 0)


def test_alloc_is_all_or_nothing():
    a = BlockAllocator(8)
    assert a.alloc(5) == [(0, 5)]
    before = snapshot(a)
    assert a.alloc(4) is None  # only 3 free
    assert snapshot(a) == before
    assert a.alloc(3) == [(5, 3)]
    assert a.alloc(1) is None
    assert a.free_blocks == 0


def test_best_fit_prefers_smallest_single_run():
    a = BlockAllocator(20)
    x = a.alloc(20)
    assert x == [(0, 20)]
    # free runs: (0,5) (6,2) (10,3) (15,5)  -> used blocks 5, 8-9, 13-14
    a.free([(0, 5), (6, 2), (10, 3), (15, 5)])
    assert a.free_runs() == [(0, 5), (6, 2), (10, 3), (15, 5)]
    assert a.alloc(3) == [(10, 3)]  # exact fit beats the two 5-runs
    assert a.alloc(2) == [(6, 2)]
    assert a.alloc(4) in ([(0, 4)], [(15, 4)])  # both 5-runs are equally good
    assert a.free_blocks == 6


def test_best_fit_single_run_even_when_it_is_not_first():
    a = BlockAllocator(12)
    a.alloc(12)
    a.free([(0, 6), (8, 2)])  # runs (0,6) and (8,2)
    assert a.alloc(2) == [(8, 2)]
    assert a.free_runs() == [(0, 6)]


def test_fragmented_alloc_uses_several_extents_largest_first():
    a = BlockAllocator(10)
    a.alloc(10)
    a.free([(0, 1), (2, 3), (6, 1), (8, 2)])  # runs of 1, 3, 1, 2 = 7 free, largest 3
    got = a.alloc(6)
    assert got is not None
    assert sum(c for _, c in got) == 6
    assert got == sorted(got)
    # the largest runs first: 3 + 2 + one of the 1-runs -> 3 extents, the minimum possible
    assert len(got) == 3
    assert (2, 3) in got and (8, 2) in got
    assert a.free_blocks == 1


def test_fragmentation_never_refuses_when_enough_blocks_are_free():
    a = BlockAllocator(16)
    a.alloc(16)
    a.free([(i, 1) for i in range(0, 16, 2)])  # every other block
    assert a.free_blocks == 8
    got = a.alloc(8)
    assert got is not None and sorted(blocks_of(got)) == list(range(0, 16, 2))
    assert a.free_runs() == []


def test_free_coalesces_with_both_neighbours():
    a = BlockAllocator(9)
    a.alloc(9)
    a.free([(0, 3)])
    a.free([(6, 3)])
    assert a.free_runs() == [(0, 3), (6, 3)]
    a.free([(3, 3)])
    assert a.free_runs() == [(0, 9)]
    assert a.free_blocks == 9


def test_free_of_several_adjacent_extents_in_one_call_coalesces():
    a = BlockAllocator(6)
    a.alloc(6)
    a.free([(4, 2), (0, 2), (2, 2)])
    assert a.free_runs() == [(0, 6)]


@pytest.mark.parametrize(
    "extent",
    [(0, 1), (3, 1), (2, 3), (0, 10), (4, 2)],
    ids=["start-of-free-run", "inside-free-run", "straddles-run-start", "covers-everything", "overlaps-run-end"],
)
def test_double_free_raises_and_changes_nothing(extent):
    a = BlockAllocator(10)
    a.alloc(10)
    a.free([(0, 2), (3, 2)])  # free runs (0,2) (3,2); block 2 and 5.. used
    # extents overlapping a free block: all of the parametrized ones touch block 0,1,3 or 4
    before = snapshot(a)
    with pytest.raises(ValueError, match="free"):
        a.free([extent])
    assert snapshot(a) == before


@pytest.mark.parametrize("extent", [(-1, 1), (9, 2), (10, 1), (0, 11), (-3, 2)])
def test_out_of_range_free_raises_and_changes_nothing(extent):
    a = BlockAllocator(10)
    a.alloc(10)
    before = snapshot(a)
    with pytest.raises(ValueError, match="outside"):
        a.free([extent])
    assert snapshot(a) == before


def test_negative_count_free_raises():
    a = BlockAllocator(4)
    a.alloc(4)
    with pytest.raises(ValueError):
        a.free([(1, -1)])
    assert a.free_blocks == 0


def test_zero_count_extent_is_ignored():
    a = BlockAllocator(4)
    a.alloc(4)
    a.free([(2, 0)])
    assert snapshot(a) == ([], 0, 4)


def test_failed_free_is_all_or_nothing():
    """A valid extent listed before a bad one must not be freed either."""
    a = BlockAllocator(10)
    a.alloc(10)
    before = snapshot(a)
    with pytest.raises(ValueError):
        a.free([(0, 2), (20, 1)])
    assert snapshot(a) == before
    with pytest.raises(ValueError):
        a.free([(0, 2), (1, 2)])  # overlapping extents within one call
    assert snapshot(a) == before
    with pytest.raises(ValueError):
        a.free([(5, 1), (5, 1)])  # the same extent twice
    assert snapshot(a) == before


def test_free_everything_returns_to_one_run():
    a = BlockAllocator(32)
    allocs = [a.alloc(n) for n in (3, 5, 1, 7, 2, 4)]
    assert all(x is not None for x in allocs)
    for x in reversed(allocs[::2]):
        a.free(x)
    for x in allocs[1::2]:
        a.free(x)
    assert a.free_runs() == [(0, 32)]
    assert a.free_blocks == 32


# ------------------------------------------------------------------------- stateful model


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc / free / partial free / bad free against a set-of-free-blocks model."""

    allocations = Bundle("allocations")

    @initialize(nblocks=st.integers(min_value=0, max_value=48))
    def setup(self, nblocks):
        self.a = BlockAllocator(nblocks)
        self.n = nblocks
        self.free_set: set[int] = set(range(nblocks))
        self.owned: dict[int, set[int]] = {}  # allocation id -> its blocks still allocated
        self.next_id = 0

    # ---- alloc

    @rule(target=allocations, count=st.integers(min_value=0, max_value=52))
    def alloc(self, count):
        model_runs = runs_of(self.free_set)
        before = snapshot(self.a)
        got = self.a.alloc(count)
        if count > len(self.free_set):
            assert got is None, f"alloc({count}) with {len(self.free_set)} free must fail"
            assert snapshot(self.a) == before
            return None
        assert got is not None, f"alloc({count}) refused with {len(self.free_set)} free blocks"
        blocks = blocks_of(got)
        assert len(blocks) == count
        assert len(set(blocks)) == count, "an allocation repeats a block"
        assert set(blocks) <= self.free_set, "handed out a block that was not free"
        assert all(c > 0 for _, c in got)
        assert got == sorted(got)
        if count:
            fitting = [length for _, length in model_runs if length >= count]
            if fitting:
                # best fit: one extent, inside a free run of the smallest length that fits
                assert len(got) == 1, f"alloc({count}) split although a run of {min(fitting)} fits"
                (start, c), = got
                containing = [length for s, length in model_runs if s <= start < s + length]
                assert containing == [min(fitting)]
            else:
                # fragmented: the fewest extents possible (largest runs first)
                lengths = sorted((length for _, length in model_runs), reverse=True)
                k, covered = 0, 0
                while covered < count:
                    covered += lengths[k]
                    k += 1
                assert len(got) == k
        self.free_set -= set(blocks)
        ident = self.next_id
        self.next_id += 1
        self.owned[ident] = set(blocks)
        return ident

    # ---- free

    @rule(ident=consumes(allocations))
    def free_whole(self, ident):
        if ident is None or ident not in self.owned:
            return
        blocks = self.owned.pop(ident)
        self.a.free([(s, c) for s, c in runs_of(blocks)])
        self.free_set |= blocks

    @rule(ident=allocations, data=st.data())
    def free_part(self, ident, data):
        """Free one sub-range of an allocation (exercises splitting and coalescing)."""
        if ident is None or not self.owned.get(ident):
            return
        runs = runs_of(self.owned[ident])
        start, length = data.draw(st.sampled_from(runs))
        off = data.draw(st.integers(0, length - 1))
        count = data.draw(st.integers(1, length - off))
        self.a.free([(start + off, count)])
        part = set(range(start + off, start + off + count))
        self.owned[ident] -= part
        self.free_set |= part

    # ---- bad frees

    @precondition(lambda self: self.free_set)
    @rule(data=st.data())
    def double_free(self, data):
        block = data.draw(st.sampled_from(sorted(self.free_set)))
        lo = data.draw(st.integers(0, block))
        hi = data.draw(st.integers(block + 1, self.n))
        before = snapshot(self.a)
        with pytest.raises(ValueError):
            self.a.free([(lo, hi - lo)])
        assert snapshot(self.a) == before

    @rule(start=st.integers(-5, 60), count=st.integers(1, 10))
    def out_of_range_free(self, start, count):
        if 0 <= start and start + count <= self.n:
            return
        before = snapshot(self.a)
        with pytest.raises(ValueError):
            self.a.free([(start, count)])
        assert snapshot(self.a) == before

    # ---- invariants

    @invariant()
    def runs_match_model(self):
        runs = self.a.free_runs()
        assert runs == runs_of(self.free_set)
        for (s1, l1), (s2, _) in zip(runs, runs[1:]):
            assert s1 + l1 < s2, f"free runs {(s1, l1)} and {(s2, _)} touch: not coalesced"
        assert all(length > 0 for _, length in runs)

    @invariant()
    def counts_match_model(self):
        assert self.a.free_blocks == len(self.free_set)
        assert self.a.used_blocks == self.n - len(self.free_set)
        owned = [b for blocks in self.owned.values() for b in blocks]
        assert len(owned) == len(set(owned)), "two allocations share a block"
        assert set(owned) | self.free_set == set(range(self.n))
        assert not set(owned) & self.free_set


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestAllocatorStateful = AllocatorMachine.TestCase
