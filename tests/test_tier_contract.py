"""One contract, every tier: the Tier protocol (``ectier/tiers/base.py``) checked the same way
over the host tier, the GPU tier (its arena in CPU memory, copies inline) and the NVMe tier.

A tier stores, fetches and accounts its own bytes: these tests drive each tier alone, without a
cache, through the protocol's questions (fits, holds, stored_version, describe, delete, close)
and each kind's way in and out (memory: admit → write → commit, pins, victims handed back;
NVMe: encode → write → read).
"""

from __future__ import annotations

import pytest
import torch

from ectier.config import GpuTierConfig, HostTierConfig, NvmeTierConfig
from ectier.copy import InlineCopyEngine
from ectier.entry import EntryMeta, entry_digest, next_version
from ectier.tiers.arena import ArenaTier
from ectier.tiers.base import Tier
from ectier.tiers.gpu import GpuTier
from ectier.tiers.host import HostTier
from ectier.tiers.nvme import NvmeTier

KiB = 1024
BLOCK = 64 * KiB
CAPACITY = 4 * BLOCK


def _meta(key: str, nbytes: int) -> EntryMeta:
    return EntryMeta("test", key, "uint8", (nbytes,), nbytes)


def _bytes(nbytes: int, seed: int) -> torch.Tensor:
    return torch.arange(nbytes, dtype=torch.int64).add(seed * 131).remainder(251).to(torch.uint8)


class _Memory:
    """Drive a memory tier: admit (evicting what it hands back), write, commit, read."""

    def __init__(self, tier: ArenaTier) -> None:
        self.tier = tier

    def store(self, key: str, data: torch.Tensor) -> int:
        d, v = entry_digest("test", key), next_version()
        adm = self.tier.admit(d, _meta(key, data.numel()), v)
        while not adm.granted:
            assert adm.victims, "no room and no victims"
            for victim in adm.victims:
                self.tier.release_victim(victim)
            adm = self.tier.admit(d, _meta(key, data.numel()), v)
        h = self.tier.write(adm.entry, data)
        if h is not None:
            assert h.wait(5) and h.error is None
        self.tier.commit(adm.entry)
        return v

    def read(self, key: str) -> torch.Tensor | None:
        slot = self.tier.lookup(entry_digest("test", key))
        if slot is None:
            return None
        out = torch.empty(slot.meta.nbytes, dtype=torch.uint8)
        h = self.tier.read_into(slot, out)
        if h is not None:
            assert h.wait(5)
        return out


class _Store:
    """Drive the NVMe tier: encode, write, read (checked)."""

    def __init__(self, tier: NvmeTier) -> None:
        self.tier = tier

    def store(self, key: str, data: torch.Tensor) -> int:
        v = next_version()
        self.tier.write(entry_digest("test", key), self.tier.encode(_meta(key, data.numel()), data, v))
        return v

    def read(self, key: str) -> torch.Tensor | None:
        got = self.tier.read(entry_digest("test", key), "test", key)
        return None if got is None else got[1]


@pytest.fixture(params=["host", "gpu-on-cpu", "nvme"])
def driver(request, tmp_path):
    if request.param == "host":
        tier = HostTier(HostTierConfig(capacity_bytes=CAPACITY, block_bytes=BLOCK, pin_memory=False))
        d = _Memory(tier)
    elif request.param == "gpu-on-cpu":
        tier = GpuTier(GpuTierConfig(capacity_bytes=CAPACITY, block_bytes=BLOCK), device=torch.device("cpu"),
                       engine=InlineCopyEngine())
        d = _Memory(tier)
    else:
        tier = NvmeTier(NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=64 * CAPACITY))
        d = _Store(tier)
    yield d
    tier.close()


def test_is_a_tier_with_a_name_and_a_budget(driver):
    t = driver.tier
    assert isinstance(t, Tier) and t.name in ("gpu", "host", "nvme")
    assert t.capacity_bytes > 0 and t.used_bytes == 0 and len(t) == 0
    info = t.describe()
    assert {"capacity_bytes", "used_bytes", "entries"} <= set(info)
    assert info["capacity_bytes"] == t.capacity_bytes and info["entries"] == 0


def test_fits_refuses_more_than_the_whole_budget(driver):
    t = driver.tier
    assert t.fits(BLOCK)
    assert not t.fits(t.capacity_bytes + 1)


def test_store_then_holds_exactly_that_version_and_reads_it_back(driver):
    t, data = driver.tier, _bytes(BLOCK + 100, 1)
    v = driver.store("k", data)
    d = entry_digest("test", "k")
    assert t.holds(d, v) and not t.holds(d, v + 1) and t.stored_version(d) == v
    assert len(t) == 1 and t.used_bytes >= data.numel() and t.describe()["entries"] == 1
    assert torch.equal(driver.read("k"), data)


def test_a_newer_version_replaces_the_older(driver):
    t = driver.tier
    v1 = driver.store("k", _bytes(100, 1))
    v2 = driver.store("k", _bytes(200, 2))
    d = entry_digest("test", "k")
    assert v2 > v1 and t.holds(d, v2) and not t.holds(d, v1) and len(t) == 1
    assert torch.equal(driver.read("k"), _bytes(200, 2))


def test_delete_forgets_and_returns_the_bytes(driver):
    t = driver.tier
    driver.store("a", _bytes(BLOCK, 1))
    driver.store("b", _bytes(BLOCK, 2))
    used = t.used_bytes
    assert t.delete(entry_digest("test", "a"))
    assert t.stored_version(entry_digest("test", "a")) is None and driver.read("a") is None
    assert t.used_bytes < used and len(t) == 1
    assert torch.equal(driver.read("b"), _bytes(BLOCK, 2))
    assert not t.delete(entry_digest("test", "never-stored"))


def test_close_is_idempotent(driver):
    driver.store("k", _bytes(10, 1))
    driver.tier.close()
    driver.tier.close()


# ------------------------------------------------------------------ memory tiers only
@pytest.fixture(params=["host", "gpu-on-cpu"])
def memory(request):
    if request.param == "host":
        tier = HostTier(HostTierConfig(capacity_bytes=CAPACITY, block_bytes=BLOCK, pin_memory=False))
    else:
        tier = GpuTier(GpuTierConfig(capacity_bytes=CAPACITY, block_bytes=BLOCK), device=torch.device("cpu"),
                       engine=InlineCopyEngine())
    yield _Memory(tier)
    tier.close()


def test_admit_hands_victims_back_instead_of_evicting_them(memory):
    t = memory.tier
    for i in range(4):
        memory.store(f"k{i}", _bytes(BLOCK, i))
    adm = t.admit(entry_digest("test", "new"), _meta("new", 2 * BLOCK), next_version())
    assert not adm.granted and [v.meta.key for v in adm.victims] == ["k0", "k1"]
    # victims are still readable (leaving, pinned for the caller) until released
    assert torch.equal(memory.read("k0"), _bytes(BLOCK, 0)) and len(t) == 4
    for v in adm.victims:
        t.release_victim(v)
    assert len(t) == 2 and t.admit(entry_digest("test", "new"), _meta("new", 2 * BLOCK), next_version()).granted


def test_pinned_entries_are_never_victims_and_abort_returns_room(memory):
    t = memory.tier
    for i in range(4):
        memory.store(f"k{i}", _bytes(BLOCK, i))
    slots = [t.lookup(entry_digest("test", f"k{i}")) for i in range(4)]
    for s in slots:
        t.pin(s)
    assert t.admit(entry_digest("test", "x"), _meta("x", BLOCK), next_version()).blocked
    t.unpin(slots[2])
    adm = t.admit(entry_digest("test", "x"), _meta("x", BLOCK), next_version())
    assert [v.meta.key for v in adm.victims] == ["k2"]
    t.release_victim(adm.victims[0])
    for s in (slots[0], slots[1], slots[3]):
        t.unpin(s)
    used = t.used_bytes
    adm = t.admit(entry_digest("test", "y"), _meta("y", BLOCK), next_version())
    assert adm.granted and t.used_bytes == used + BLOCK
    t.abort(adm.entry)
    assert t.used_bytes == used and t.lookup(entry_digest("test", "y")) is None


def test_admit_refuses_an_entry_larger_than_the_whole_tier_before_evicting_anything(memory):
    t = memory.tier
    for i in range(4):
        memory.store(f"k{i}", _bytes(BLOCK, i))
    adm = t.admit(entry_digest("test", "huge"), _meta("huge", t.capacity_bytes + 1), next_version())
    assert adm.too_large and not adm.granted and not adm.victims
    assert len(t) == 4 and all(memory.read(f"k{i}") is not None for i in range(4))
