"""Tests for ectier.policy.LRUPolicy: victim order, all-or-nothing, protection, add/touch/remove.

Random operation sequences are checked against a plain list kept in recency order.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ectier.policy import EvictionPolicy, LRUPolicy


def make(*items):
    p = LRUPolicy()
    for key, nbytes in items:
        p.add(key, nbytes)
    return p


def test_is_an_eviction_policy():
    assert isinstance(LRUPolicy(), EvictionPolicy)


def test_victims_least_recently_added_first():
    p = make(("a", 10), ("b", 10), ("c", 10))
    assert p.victims(1) == ["a"]
    assert p.victims(10) == ["a"]
    assert p.victims(11) == ["a", "b"]
    assert p.victims(30) == ["a", "b", "c"]


def test_victims_do_not_remove():
    p = make(("a", 10), ("b", 10))
    p.victims(20)
    assert len(p) == 2 and "a" in p and "b" in p
    assert list(p) == ["a", "b"]


def test_touch_moves_to_most_recently_used():
    p = make(("a", 10), ("b", 10), ("c", 10))
    p.touch("a")
    assert list(p) == ["b", "c", "a"]
    assert p.victims(15) == ["b", "c"]
    p.touch("b")
    assert p.victims(1) == ["c"]


def test_touch_unknown_key_is_noop():
    p = make(("a", 1))
    p.touch("zzz")
    assert list(p) == ["a"] and "zzz" not in p


def test_victims_all_or_nothing():
    p = make(("a", 10), ("b", 20))
    assert p.victims(31) is None
    assert p.victims(30) == ["a", "b"]


def test_victims_on_empty_policy():
    p = LRUPolicy()
    assert p.victims(1) is None
    assert p.victims(0) == []


@pytest.mark.parametrize("need", [0, -1, -100])
def test_nonpositive_need_gives_empty_list(need):
    p = make(("a", 10))
    assert p.victims(need) == []
    assert p.victims(need, protected=lambda k: True) == []


def test_protected_entries_are_skipped():
    p = make(("a", 10), ("b", 10), ("c", 10))
    assert p.victims(15, protected=lambda k: k == "a") == ["b", "c"]
    assert p.victims(10, protected=lambda k: k in ("a", "b")) == ["c"]


def test_protected_bytes_do_not_count_toward_need():
    p = make(("a", 100), ("b", 10))
    # 110 bytes tracked, but only 10 unprotected: 20 cannot be covered
    assert p.victims(20, protected=lambda k: k == "a") is None
    assert p.victims(10, protected=lambda k: k == "a") == ["b"]
    assert p.victims(1, protected=lambda k: True) is None


def test_stops_as_soon_as_need_is_covered():
    p = make(("big", 100), ("x", 1), ("y", 1))
    assert p.victims(5) == ["big"]


def test_add_existing_key_updates_size_and_moves_to_mru():
    p = make(("a", 10), ("b", 10))
    p.add("a", 50)
    assert list(p) == ["b", "a"]
    assert len(p) == 2
    assert p.victims(11) == ["b", "a"]
    assert p.victims(60) == ["b", "a"]
    assert p.victims(61) is None


def test_add_negative_size_raises():
    p = LRUPolicy()
    with pytest.raises(ValueError, match="nbytes"):
        p.add("a", -1)
    assert len(p) == 0


def test_zero_byte_entries():
    p = make(("z", 0), ("a", 5))
    assert p.victims(5) == ["z", "a"]  # a zero-byte entry is evicted on the way, harmlessly
    assert p.victims(6) is None


def test_remove_and_remove_unknown():
    p = make(("a", 10), ("b", 10))
    p.remove("a")
    assert "a" not in p and len(p) == 1
    assert p.victims(10) == ["b"]
    assert p.victims(11) is None
    p.remove("a")  # no-op
    p.remove("never")
    assert list(p) == ["b"]


def test_readd_after_remove_is_mru():
    p = make(("a", 1), ("b", 1))
    p.remove("a")
    p.add("a", 1)
    assert list(p) == ["b", "a"]


def test_iter_is_a_snapshot():
    p = make(("a", 1), ("b", 1))
    it = iter(p)
    p.remove("a")
    p.add("c", 1)
    assert list(it) == ["a", "b"]


def test_bytes_keys_like_the_cache_uses():
    p = make((b"\x00" * 32, 4), (b"\x01" * 32, 4))
    assert p.victims(4) == [b"\x00" * 32]


# ------------------------------------------------------------------------- random sequences

KEYS = st.sampled_from("abcdefgh")
OPS = st.one_of(
    st.tuples(st.just("add"), KEYS, st.integers(0, 50)),
    st.tuples(st.just("touch"), KEYS),
    st.tuples(st.just("remove"), KEYS),
    st.tuples(st.just("victims"), st.integers(-5, 300), st.frozensets(KEYS)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(OPS, max_size=40))
def test_matches_reference_model(ops):
    p = LRUPolicy()
    model: list[list] = []  # [key, nbytes], LRU first

    def find(key):
        return next((i for i, (k, _) in enumerate(model) if k == key), None)

    for op in ops:
        if op[0] == "add":
            _, key, nbytes = op
            p.add(key, nbytes)
            i = find(key)
            if i is not None:
                model.pop(i)
            model.append([key, nbytes])
        elif op[0] == "touch":
            p.touch(op[1])
            i = find(op[1])
            if i is not None:
                model.append(model.pop(i))
        elif op[0] == "remove":
            p.remove(op[1])
            i = find(op[1])
            if i is not None:
                model.pop(i)
        else:
            _, need, protected = op
            got = p.victims(need, protected=protected.__contains__)
            candidates = [(k, n) for k, n in model if k not in protected]
            if need <= 0:
                assert got == []
            elif sum(n for _, n in candidates) < need:
                assert got is None
            else:
                assert got is not None
                sizes = dict(model)
                assert not set(got) & protected, "a protected key was chosen"
                # the victims are the LRU-first prefix of the unprotected entries ...
                assert got == [k for k, _ in candidates[: len(got)]]
                # ... that covers need, and no shorter prefix does
                assert sum(sizes[k] for k in got) >= need
                assert sum(sizes[k] for k in got[:-1]) < need
        assert list(p) == [k for k, _ in model]
        assert len(p) == len(model)
        for key in "abcdefgh":
            assert (key in p) == (find(key) is not None)
