"""An NVMe budget the disk cannot hold is refused at open (issue 12, item 4).

Before: ``nvme.capacity_bytes`` far above the filesystem's size was accepted silently, and the
tier found out at its first ``ENOSPC``. Now opening such a store is a ``ConfigError`` naming
``nvme.capacity_bytes`` and the free bytes; what the store's records already take counts as room
(a store reopened on a full disk keeps its budget); ``nvme.thin_provisioning: true`` opts out.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import MiB, make_config
from ectier import TieredCache
from ectier.config import CacheConfig
from ectier.errors import ConfigError

HUGE = 1 << 60  # one EiB: no filesystem a test runs on has that free


class _Statvfs:
    """What ``os.statvfs`` answers for a filesystem with ``free`` bytes available."""

    def __init__(self, free: int) -> None:
        self.f_frsize = 4096
        self.f_bavail = free // 4096


def _free_disk(monkeypatch, free: int) -> None:
    monkeypatch.setattr(os, "statvfs", lambda path: _Statvfs(free))


def test_a_capacity_above_the_free_space_is_a_config_error_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"^nvme\.capacity_bytes: 1152921504606846976 bytes .* free") as err:
        TieredCache(make_config(tmp_path / "nvme", nvme_bytes=HUGE))
    assert "nvme.thin_provisioning" in str(err.value)
    assert str(tmp_path / "nvme") in str(err.value)
    # nothing stays open or locked: the same directory opens at once with a budget that fits
    with TieredCache(make_config(tmp_path / "nvme", nvme_bytes=MiB)) as cache:
        cache.put("k", torch.ones(1024, dtype=torch.uint8))
        assert cache.get("k") is not None


def test_the_message_gives_the_free_bytes(tmp_path, monkeypatch):
    _free_disk(monkeypatch, 64 * MiB)
    with pytest.raises(ConfigError, match=rf"has {64 * MiB} bytes \(0\.06 GiB\) free;"):
        TieredCache(make_config(tmp_path / "nvme", nvme_bytes=65 * MiB))
    with TieredCache(make_config(tmp_path / "nvme", nvme_bytes=64 * MiB)):
        pass  # exactly the free space fits


def test_thin_provisioning_accepts_a_budget_above_the_free_space(tmp_path):
    cfg = CacheConfig.from_dict({"host": {"capacity_bytes": "1MiB"},
                                 "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": HUGE,
                                          "thin_provisioning": True, "sync": False}})
    assert cfg.nvme.thin_provisioning is True
    with TieredCache(cfg) as cache:
        cache.put("k", torch.ones(1024, dtype=torch.uint8))
        assert cache.flush() == 1
        assert cache.stats()["tiers"]["nvme"]["capacity_bytes"] == HUGE


def test_bytes_the_store_already_holds_count_as_room(tmp_path, monkeypatch):
    """A store reopened on a disk its own records filled keeps its budget."""
    path = tmp_path / "nvme"
    with TieredCache(make_config(path, nvme_bytes=4 * MiB)) as cache:
        for i in range(3):
            cache.put(f"k{i}", torch.full((256 * 1024,), i, dtype=torch.uint8))
        cache.flush()
        held = cache.stats()["tiers"]["nvme"]["used_bytes"]
    assert held >= 3 * 256 * 1024
    _free_disk(monkeypatch, 1 * MiB)
    with TieredCache(make_config(path, nvme_bytes=1 * MiB + held)) as cache:
        assert cache.get("k2") is not None
    with pytest.raises(ConfigError, match=rf"free \+ {held} bytes its records already take"):
        TieredCache(make_config(path, nvme_bytes=1 * MiB + held + 4096))


def test_thin_provisioning_must_be_a_bool():
    with pytest.raises(ConfigError, match=r"^nvme\.thin_provisioning: expected true/false"):
        CacheConfig.from_dict({"nvme": {"thin_provisioning": "sometimes"}})


def test_a_store_reopened_with_a_lower_budget_warns_once_naming_the_field_and_the_evictions(tmp_path, caplog):
    """A lowered ``nvme.capacity_bytes`` (or a typo in it) evicts stored entries at open: one
    WARNING says how many and names the field; the entries that fit stay byte-exact."""
    values = {f"k{i}": torch.full((64, 1024), float(i), dtype=torch.bfloat16) for i in range(8)}  # 128 KiB each
    with TieredCache(make_config(tmp_path / "nvme", host_bytes=0, nvme_bytes=8 * MiB)) as cache:
        for k, v in values.items():
            cache.put(k, v)
    with caplog.at_level("WARNING", logger="ectier"):
        with TieredCache(make_config(tmp_path / "nvme", host_bytes=0, nvme_bytes=MiB // 2)) as cache:
            kept = {k: cache.get(k) for k in values}
    warned = [r.getMessage() for r in caplog.records if "at open" in r.getMessage()]
    assert len(warned) == 1 and "nvme.capacity_bytes=524288" in warned[0], warned
    lost = [k for k, got in kept.items() if got is None]
    assert lost and f"evicted the {len(lost)} least recently used" in warned[0], (lost, warned)
    for k, got in kept.items():
        assert got is None or torch.equal(got, values[k])
    assert lost == [f"k{i}" for i in range(len(lost))]  # the oldest went first


@pytest.mark.parametrize("capacity", [1, 4096, 64 * 1024 - 1])
def test_a_capacity_below_one_segment_block_is_a_config_error_and_creates_nothing(tmp_path, capacity):
    # a unit left out ("1" meant 1 GiB): before, the store opened and every put failed
    with pytest.raises(ConfigError, match=rf"^nvme\.capacity_bytes: {capacity} bytes is below one 64 KiB block"):
        TieredCache(make_config(tmp_path / "nvme", nvme_bytes=capacity))
    assert not (tmp_path / "nvme").exists()
    with TieredCache(make_config(tmp_path / "nvme", nvme_bytes=64 * 1024)) as cache:  # one block: opens
        assert len(cache) == 0
