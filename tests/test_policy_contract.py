"""One contract, every eviction policy: what the tiers rely on, checked over LRU and GDSF alike
(the policy-specific orders live in test_policy.py and test_policy_gdsf.py)."""

from __future__ import annotations

import pytest

from ectier.policy import EvictionPolicy, GDSFPolicy, LRUPolicy, make_policy


@pytest.fixture(params=["lru", "gdsf"])
def policy(request) -> EvictionPolicy:
    return make_policy(request.param)


def test_factory_builds_each_kind():
    assert isinstance(make_policy("lru"), LRUPolicy) and isinstance(make_policy("gdsf"), GDSFPolicy)


def test_victims_cover_the_need_all_or_nothing_and_do_not_remove(policy):
    for k, n in (("a", 10), ("b", 20), ("c", 30)):
        policy.add(k, n)
    got = policy.victims(25)
    assert got is not None and sum({"a": 10, "b": 20, "c": 30}[k] for k in got) >= 25
    assert len(policy) == 3 and all(k in policy for k in "abc")  # choosing is not removing
    assert policy.victims(61) is None  # more than everything: none at all


def test_protected_keys_are_never_chosen_nor_counted(policy):
    for k in "abc":
        policy.add(k, 10)
    got = policy.victims(20, protected=lambda k: k == "a")
    assert got is not None and "a" not in got and sum(10 for _ in got) >= 20
    assert policy.victims(21, protected=lambda k: k == "a") is None


@pytest.mark.parametrize("need", [0, -5])
def test_nothing_needed_is_an_empty_list(policy, need):
    policy.add("a", 10)
    assert policy.victims(need) == []


def test_remove_touch_and_iteration(policy):
    policy.add("a", 10)
    policy.add("b", 10)
    policy.touch("a")
    policy.touch("unknown")  # a no-op
    policy.remove("b")
    policy.remove("unknown")  # a no-op
    assert list(policy) == ["a"] and len(policy) == 1 and "b" not in policy
    snapshot = iter(policy)
    policy.add("c", 1)
    assert list(snapshot) == ["a"]


def test_zero_byte_entries_and_negative_sizes(policy):
    policy.add("z", 0)
    assert "z" in policy
    with pytest.raises(ValueError):
        policy.add("neg", -1)


def test_replace_is_remove_then_add(policy):
    """``replace`` (a tracked entry overwritten by a newer version) leaves the policy as ``remove``
    then ``add`` would: the same size, order and victims."""
    other = make_policy("lru" if isinstance(policy, LRUPolicy) else "gdsf")
    for p in (policy, other):
        for k, n in (("a", 10), ("b", 20), ("c", 30)):
            p.add(k, n, 1.0)
    policy.replace("a", 25, 2.0)
    other.remove("a")
    other.add("a", 25, 2.0)
    assert list(policy) == list(other) and len(policy) == 3
    for need in (10, 30, 55, 85):
        assert policy.victims(need) == other.victims(need)
    assert policy.victims(86) is None  # the new size counts, the old one is gone
