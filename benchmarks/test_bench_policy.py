"""Micro-benchmarks of eviction policies and index lookups at 10^5 entries (pytest-benchmark).

Run: ``.venv/bin/python -m pytest benchmarks/test_bench_policy.py -p no:cacheprovider --benchmark-only``
"""

from __future__ import annotations

import random

import pytest

from ectier.entry import EntryMeta, entry_digest
from ectier.index import ArenaIndex
from ectier.policy import GDSFPolicy, LRUPolicy

N = 100_000
POLICIES = {"lru": LRUPolicy, "gdsf": GDSFPolicy}


def _filled(name: str):
    p = POLICIES[name]()
    rng = random.Random(0)
    keys = [entry_digest("bench", f"k{i}") for i in range(N)]
    for k in keys:
        p.add(k, rng.randrange(1, 64) << 20, cost=rng.uniform(0.017, 0.15))
    return p, keys


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_touch(benchmark, name):
    p, keys = _filled(name)
    rng = random.Random(1)
    sample = [keys[rng.randrange(N)] for _ in range(1000)]

    def run():
        for k in sample:
            p.touch(k)

    benchmark(run)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_victims_then_readd(benchmark, name):
    """One admission: victims covering 64 MiB, remove them, add the newcomer and re-add the victims."""
    p, keys = _filled(name)

    def run():
        vs = p.victims(64 << 20)
        for v in vs:
            p.remove(v)
        for v in vs:
            p.add(v, 1 << 20, cost=0.02)

    benchmark(run)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_add_remove(benchmark, name):
    p, keys = _filled(name)
    extra = [entry_digest("bench", f"x{i}") for i in range(1000)]

    def run():
        for k in extra:
            p.add(k, 1 << 20, cost=0.02)
        for k in extra:
            p.remove(k)

    benchmark(run)


def test_index_lookup(benchmark):
    block = 4096
    ix = ArenaIndex(N * block, block)
    digests = []
    for i in range(N):
        d = entry_digest("bench", f"k{i}")
        slot = ix.reserve(d, EntryMeta("bench", f"k{i}", "uint8", (block,), block), i + 1)
        ix.commit(slot)
        digests.append(d)
    rng = random.Random(2)
    sample = [digests[rng.randrange(N)] for _ in range(1000)]

    def run():
        for d in sample:
            s = ix.lookup(d)
            ix.touch(s)

    benchmark(run)
