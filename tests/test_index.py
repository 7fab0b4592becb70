"""Tests for ectier.index.ArenaIndex: reserve/commit/abort, pins, victims, remove, byte accounting.

Scenario tests walk the lifecycle one step at a time; a Hypothesis state machine then runs random
sequences against a small reference model (states, pins, LRU order, bytes).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ectier.entry import EntryMeta, EntryState
from ectier.index import ArenaIndex, Slot

BLOCK = 4096


def meta(nbytes: int, key: str = "k") -> EntryMeta:
    return EntryMeta("ns", key, "uint8", (nbytes,), nbytes)


def digest(name: str) -> bytes:
    return name.encode().ljust(32, b"\0")


def committed(ix: ArenaIndex, name: str, nbytes: int) -> Slot:
    slot = ix.reserve(digest(name), meta(nbytes, name), 1)
    assert slot is not None
    ix.commit(slot)
    return slot


# ------------------------------------------------------------------------------ accounting


def test_capacity_rounds_down_to_whole_blocks():
    ix = ArenaIndex(10 * BLOCK + 123, BLOCK)
    assert ix.capacity_bytes == 10 * BLOCK
    assert ix.free_bytes == 10 * BLOCK
    assert ix.used_bytes == 0 and ix.reserved_bytes == 0 and len(ix) == 0


@pytest.mark.parametrize("block", [0, -1])
def test_bad_block_bytes(block):
    with pytest.raises(ValueError, match="block_bytes"):
        ArenaIndex(1 << 20, block)


@pytest.mark.parametrize(
    "nbytes, expected",
    [(0, 0), (1, BLOCK), (BLOCK - 1, BLOCK), (BLOCK, BLOCK), (BLOCK + 1, 2 * BLOCK), (5 * BLOCK, 5 * BLOCK)],
)
def test_alloc_bytes_rounds_up(nbytes, expected):
    assert ArenaIndex(100 * BLOCK, BLOCK).alloc_bytes(nbytes) == expected


def test_fits_is_about_the_whole_budget_not_the_free_bytes():
    ix = ArenaIndex(4 * BLOCK, BLOCK)
    committed(ix, "a", 4 * BLOCK)
    assert ix.free_bytes == 0
    assert ix.fits(4 * BLOCK)
    assert not ix.fits(4 * BLOCK + 1)


# ------------------------------------------------------------------------------- lifecycle


def test_reserve_is_invisible_but_accounted():
    ix = ArenaIndex(4 * BLOCK, BLOCK)
    slot = ix.reserve(digest("a"), meta(BLOCK + 1), 7)
    assert slot is not None
    assert slot.state is EntryState.RESERVED and not slot.visible and slot.pins == 0
    assert slot.alloc_bytes == 2 * BLOCK
    assert slot.version == 7
    assert sum(c for _, c in slot.extents) == 2
    assert ix.lookup(digest("a")) is None and digest("a") not in ix
    assert ix.reserved_bytes == 2 * BLOCK
    assert ix.used_bytes == 2 * BLOCK
    assert ix.free_bytes == 2 * BLOCK
    assert ix.slots() == []


def test_reserve_returns_none_when_short_and_changes_nothing():
    ix = ArenaIndex(4 * BLOCK, BLOCK)
    committed(ix, "a", 3 * BLOCK)
    assert ix.reserve(digest("b"), meta(2 * BLOCK), 1) is None
    assert ix.used_bytes == 3 * BLOCK and ix.reserved_bytes == 0
    assert ix.reserve(digest("b"), meta(BLOCK), 1) is not None


def test_commit_makes_visible_and_moves_bytes_from_reserved():
    ix = ArenaIndex(4 * BLOCK, BLOCK)
    slot = ix.reserve(digest("a"), meta(BLOCK), 1)
    assert ix.commit(slot) is None  # nothing replaced
    assert slot.state is EntryState.COMMITTED and slot.visible
    assert ix.lookup(digest("a")) is slot and digest("a") in ix and len(ix) == 1
    assert ix.reserved_bytes == 0
    assert ix.used_bytes == BLOCK
    assert ix.slots() == [slot]


def test_abort_returns_bytes():
    ix = ArenaIndex(4 * BLOCK, BLOCK)
    slot = ix.reserve(digest("a"), meta(3 * BLOCK), 1)
    ix.abort(slot)
    assert ix.reserved_bytes == 0 and ix.used_bytes == 0 and ix.free_bytes == 4 * BLOCK
    assert ix.lookup(digest("a")) is None
    assert ix.reserve(digest("b"), meta(4 * BLOCK), 1) is not None


def test_zero_byte_entry():
    ix = ArenaIndex(BLOCK, BLOCK)
    slot = ix.reserve(digest("z"), EntryMeta("ns", "z", "float32", (0, 8), 0), 1)
    assert slot is not None and slot.extents == [] and slot.alloc_bytes == 0
    ix.commit(slot)
    assert ix.lookup(digest("z")) is slot and ix.used_bytes == 0
    assert ix.remove(slot) is True


@pytest.mark.parametrize("second", ["commit", "abort"])
def test_commit_or_abort_after_abort_raises(second):
    """An aborted slot's blocks may already belong to another entry: it must never become visible."""
    ix = ArenaIndex(2 * BLOCK, BLOCK)
    slot = ix.reserve(digest("a"), meta(BLOCK), 1)
    ix.abort(slot)
    other = ix.reserve(digest("b"), meta(2 * BLOCK), 1)  # takes the blocks back
    assert other is not None
    with pytest.raises(ValueError):
        getattr(ix, second)(slot)
    assert ix.lookup(digest("a")) is None
    assert ix.reserved_bytes == 2 * BLOCK
    assert ix.used_bytes == 2 * BLOCK


@pytest.mark.parametrize("call", ["commit", "abort"])
def test_commit_or_abort_of_committed_slot_raises(call):
    ix = ArenaIndex(2 * BLOCK, BLOCK)
    slot = committed(ix, "a", BLOCK)
    with pytest.raises(ValueError, match=call):
        getattr(ix, call)(slot)
    assert ix.lookup(digest("a")) is slot and ix.used_bytes == BLOCK and ix.reserved_bytes == 0


def test_commit_of_leaving_slot_raises():
    ix = ArenaIndex(2 * BLOCK, BLOCK)
    slot = committed(ix, "a", BLOCK)
    assert ix.victims(1) == [slot]
    with pytest.raises(ValueError):
        ix.commit(slot)


def test_commit_replaces_old_slot_and_frees_it():
    ix = ArenaIndex(4 * BLOCK, BLOCK)
    old = committed(ix, "a", 2 * BLOCK)
    new = ix.reserve(digest("a"), meta(BLOCK), 2)
    assert ix.used_bytes == 3 * BLOCK
    assert ix.commit(new) is old
    assert ix.lookup(digest("a")) is new
    assert not old.visible and old.state is EntryState.LEAVING
    assert ix.used_bytes == BLOCK  # old blocks freed at once (unpinned)
    assert len(ix) == 1
    assert ix.victims(BLOCK) == [new]  # the old one is not in the LRU any more


def test_commit_replacing_pinned_slot_frees_old_blocks_only_at_unpin():
    ix = ArenaIndex(4 * BLOCK, BLOCK)
    old = committed(ix, "a", 2 * BLOCK)
    ix.pin(old)
    new = ix.reserve(digest("a"), meta(2 * BLOCK), 2)
    assert ix.commit(new) is old
    assert ix.lookup(digest("a")) is new
    assert ix.used_bytes == 4 * BLOCK  # reader still copying from the old bytes
    assert ix.reserve(digest("b"), meta(BLOCK), 3) is None
    assert ix.unpin(old) is True
    assert ix.used_bytes == 2 * BLOCK


# ------------------------------------------------------------------------------------ pins


def test_pin_unpin_counts():
    ix = ArenaIndex(2 * BLOCK, BLOCK)
    slot = committed(ix, "a", BLOCK)
    ix.pin(slot)
    ix.pin(slot)
    assert slot.pins == 2
    assert ix.unpin(slot) is False
    assert ix.unpin(slot) is False  # still visible: nothing to free
    assert slot.pins == 0
    with pytest.raises(ValueError, match="not pinned"):
        ix.unpin(slot)
    assert ix.lookup(digest("a")) is slot and ix.used_bytes == BLOCK


def test_pinned_slot_is_never_a_victim():
    ix = ArenaIndex(3 * BLOCK, BLOCK)
    a = committed(ix, "a", BLOCK)
    b = committed(ix, "b", BLOCK)
    ix.pin(a)
    assert ix.victims(BLOCK) == [b]
    assert a.state is EntryState.COMMITTED
    assert ix.victims(BLOCK) is None  # b already leaving, a pinned
    assert ix.evictable_bytes() == 0
    ix.unpin(a)
    assert ix.evictable_bytes() == BLOCK
    assert ix.victims(BLOCK) == [a]


def test_victims_all_or_nothing_changes_nothing_when_short():
    ix = ArenaIndex(4 * BLOCK, BLOCK)
    a = committed(ix, "a", BLOCK)
    b = committed(ix, "b", BLOCK)
    ix.pin(b)
    assert ix.victims(2 * BLOCK) is None
    assert a.state is EntryState.COMMITTED and b.state is EntryState.COMMITTED
    assert ix.victims(BLOCK) == [a]


def test_victims_lru_order_and_touch():
    ix = ArenaIndex(8 * BLOCK, BLOCK)
    a, b, c = (committed(ix, n, BLOCK) for n in "abc")
    ix.touch(a)
    assert [s.meta.key for s in ix.slots()] == ["b", "c", "a"]
    got = ix.victims(2 * BLOCK)
    assert got == [b, c]
    assert all(s.state is EntryState.LEAVING and s.visible for s in got)
    # leaving slots stay readable until removed, and are never chosen again
    assert ix.lookup(digest("b")) is b
    assert ix.victims(BLOCK) == [a]
    assert ix.victims(1) is None


def test_victims_need_zero():
    ix = ArenaIndex(2 * BLOCK, BLOCK)
    committed(ix, "a", BLOCK)
    assert ix.victims(0) == []


def test_touch_of_leaving_slot_does_not_bring_it_back():
    ix = ArenaIndex(2 * BLOCK, BLOCK)
    a = committed(ix, "a", BLOCK)
    assert ix.victims(1) == [a]
    ix.touch(a)
    assert ix.victims(1) is None


def test_reserved_slot_is_never_a_victim():
    ix = ArenaIndex(4 * BLOCK, BLOCK)
    ix.reserve(digest("r"), meta(2 * BLOCK), 1)
    a = committed(ix, "a", BLOCK)
    assert ix.victims(2 * BLOCK) is None
    assert ix.victims(BLOCK) == [a]


# ---------------------------------------------------------------------------------- remove


def test_remove_victim_frees_blocks():
    ix = ArenaIndex(2 * BLOCK, BLOCK)
    a = committed(ix, "a", 2 * BLOCK)
    (v,) = ix.victims(BLOCK)
    assert v is a
    assert ix.remove(a) is True
    assert ix.lookup(digest("a")) is None and len(ix) == 0
    assert ix.used_bytes == 0
    assert ix.remove(a) is False  # second remove: nothing happens
    assert ix.used_bytes == 0


def test_remove_committed_slot_directly():
    ix = ArenaIndex(2 * BLOCK, BLOCK)
    a = committed(ix, "a", BLOCK)
    assert ix.remove(a) is True
    assert not a.visible and a.state is EntryState.LEAVING
    assert ix.victims(1) is None  # gone from the LRU too
    assert ix.used_bytes == 0


def test_removed_while_pinned_is_freed_at_last_unpin():
    ix = ArenaIndex(2 * BLOCK, BLOCK)
    a = committed(ix, "a", 2 * BLOCK)
    ix.pin(a)
    ix.pin(a)
    assert ix.remove(a) is False
    assert ix.lookup(digest("a")) is None  # invisible at once
    assert ix.used_bytes == 2 * BLOCK  # bytes still being read
    assert ix.reserve(digest("b"), meta(BLOCK), 1) is None
    assert ix.unpin(a) is False
    assert ix.used_bytes == 2 * BLOCK
    assert ix.unpin(a) is True
    assert ix.used_bytes == 0
    with pytest.raises(ValueError):
        ix.pin(a)  # freed: its blocks may hold another entry now


def test_remove_of_reserved_slot_is_a_noop():
    ix = ArenaIndex(2 * BLOCK, BLOCK)
    r = ix.reserve(digest("a"), meta(BLOCK), 1)
    assert ix.remove(r) is False
    assert r.state is EntryState.RESERVED
    assert ix.reserved_bytes == BLOCK
    ix.abort(r)
    assert ix.used_bytes == 0


def test_remove_of_old_reserved_slot_does_not_drop_the_visible_one():
    ix = ArenaIndex(4 * BLOCK, BLOCK)
    visible = committed(ix, "a", BLOCK)
    pending = ix.reserve(digest("a"), meta(BLOCK), 2)
    ix.remove(pending)
    assert ix.lookup(digest("a")) is visible


def test_slots_lists_committed_lru_first_then_leaving():
    ix = ArenaIndex(8 * BLOCK, BLOCK)
    a, b, c = (committed(ix, n, BLOCK) for n in "abc")
    (v,) = ix.victims(1)
    assert v is a
    ix.touch(b)
    assert ix.slots() == [c, b, a]


# --------------------------------------------------------------------------- state machine

NAMES = ["a", "b", "c", "d"]


class IndexMachine(RuleBasedStateMachine):
    """Random lifecycle calls against a reference model of slots, pins, LRU order and bytes."""

    def __init__(self):
        super().__init__()
        self.ix = ArenaIndex(12 * BLOCK, BLOCK)
        self.live: list[Slot] = []  # every slot not yet freed (reserved, visible or pinned-invisible)
        self.visible: dict[bytes, Slot] = {}
        self.lru: list[Slot] = []  # committed, not leaving, LRU first
        self.freed: list[Slot] = []

    # ---- model helpers

    def _model_remove(self, slot: Slot) -> bool:
        if self.visible.get(slot.digest) is slot:
            del self.visible[slot.digest]
        if slot in self.lru:
            self.lru.remove(slot)
        if slot.state is EntryState.RESERVED or slot in self.freed:
            return False
        if slot.pins == 0:
            self.live.remove(slot)
            self.freed.append(slot)
            return True
        return False

    def _pick(self, data, pool):
        return data.draw(st.sampled_from(pool))

    # ---- rules

    @rule(name=st.sampled_from(NAMES), nbytes=st.integers(0, 5 * BLOCK))
    def reserve(self, name, nbytes):
        used_before = self.ix.used_bytes
        slot = self.ix.reserve(digest(name), meta(nbytes, name), 1)
        need = -(-nbytes // BLOCK) * BLOCK
        if need > self.ix.capacity_bytes - used_before:
            assert slot is None
            return
        assert slot is not None and slot.alloc_bytes == need
        self.live.append(slot)

    @precondition(lambda self: any(s.state is EntryState.RESERVED for s in self.live))
    @rule(data=st.data())
    def commit(self, data):
        slot = self._pick(data, [s for s in self.live if s.state is EntryState.RESERVED])
        old = self.visible.get(slot.digest)
        expected_old = old
        if old is not None:
            self._model_remove(old)
        got = self.ix.commit(slot)
        assert got is expected_old
        self.visible[slot.digest] = slot
        self.lru.append(slot)

    @precondition(lambda self: any(s.state is EntryState.RESERVED for s in self.live))
    @rule(data=st.data())
    def abort(self, data):
        slot = self._pick(data, [s for s in self.live if s.state is EntryState.RESERVED])
        self.ix.abort(slot)
        self.live.remove(slot)
        self.freed.append(slot)

    @precondition(lambda self: self.visible)
    @rule(data=st.data())
    def pin(self, data):
        slot = self._pick(data, list(self.visible.values()))
        self.ix.pin(slot)

    @precondition(lambda self: any(s.pins for s in self.live))
    @rule(data=st.data())
    def unpin(self, data):
        slot = self._pick(data, [s for s in self.live if s.pins])
        freed = self.ix.unpin(slot)
        should_free = slot.pins == 0 and slot not in self.visible.values() and slot.state is not EntryState.RESERVED
        assert freed == should_free
        if freed:
            self.live.remove(slot)
            self.freed.append(slot)

    @precondition(lambda self: self.visible)
    @rule(data=st.data())
    def touch(self, data):
        slot = self._pick(data, list(self.visible.values()))
        self.ix.touch(slot)
        if slot in self.lru:
            self.lru.remove(slot)
            self.lru.append(slot)

    @rule(need=st.integers(-BLOCK, 14 * BLOCK))
    def victims(self, need):
        got = self.ix.victims(need)
        if need <= 0:
            assert got == []
            return
        chosen, covered = [], 0
        for s in self.lru:
            if s.pins:
                continue
            chosen.append(s)
            covered += s.alloc_bytes
            if covered >= need:
                break
        if covered < need:
            assert got is None
            return
        assert got == chosen
        for s in got:
            assert s.pins == 0, "a pinned slot was chosen"
            assert s.state is EntryState.LEAVING and s.visible
            self.lru.remove(s)

    @precondition(lambda self: self.visible)
    @rule(data=st.data())
    def remove(self, data):
        slot = self._pick(data, list(self.visible.values()))
        expected = self._model_remove(slot)
        assert self.ix.remove(slot) is expected
        assert not slot.visible and slot.state is EntryState.LEAVING

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def wrong_state_calls(self, data):
        slot = self._pick(data, self.freed)
        before = (self.ix.used_bytes, self.ix.reserved_bytes, len(self.ix))
        for call in (self.ix.commit, self.ix.abort, self.ix.pin, self.ix.unpin):
            with pytest.raises(ValueError):
                call(slot)
        assert (self.ix.used_bytes, self.ix.reserved_bytes, len(self.ix)) == before

    # ---- invariants

    @invariant()
    def bytes_match(self):
        assert self.ix.used_bytes == sum(s.alloc_bytes for s in self.live)
        assert self.ix.reserved_bytes == sum(s.alloc_bytes for s in self.live if s.state is EntryState.RESERVED)
        assert self.ix.free_bytes == self.ix.capacity_bytes - self.ix.used_bytes
        assert self.ix.evictable_bytes() == sum(s.alloc_bytes for s in self.lru if s.pins == 0)

    @invariant()
    def blocks_never_shared(self):
        blocks = [b for s in self.live for start, n in s.extents for b in range(start, start + n)]
        assert len(blocks) == len(set(blocks)), "two live slots share a block"

    @invariant()
    def visibility_matches(self):
        for name in NAMES:
            assert self.ix.lookup(digest(name)) is self.visible.get(digest(name))
        assert len(self.ix) == len(self.visible)
        for s in self.live + self.freed:
            assert s.visible == (self.visible.get(s.digest) is s)
        lru_order = [s for s in self.ix.slots() if s.state is EntryState.COMMITTED]
        assert lru_order == self.lru


IndexMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestIndexStateful = IndexMachine.TestCase
