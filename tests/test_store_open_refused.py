"""An open of an NVMe store that is refused leaves no directory behind that it created
(ectier/tiers/storedir.py: ``missing_dirs`` / ``remove_created``), and removes nothing it did not
create: a directory that was there stays with what it holds, a store stays readable."""

from __future__ import annotations

import pytest
import torch

from conftest import MiB, make_config
from ectier import TieredCache
from ectier.errors import ConfigError, StoreLockedError

HUGE = 1 << 60  # one EiB: a budget no filesystem a test runs on holds (refused: nvme.capacity_bytes)


def test_a_refused_open_leaves_no_directory_it_created(tmp_path):
    path = tmp_path / "a" / "b" / "nvme"
    with pytest.raises(ConfigError, match=r"^nvme\.capacity_bytes"):
        TieredCache(make_config(path, nvme_bytes=HUGE))
    assert list(tmp_path.iterdir()) == []  # neither the store directory nor its parents


def test_a_refused_open_keeps_a_directory_that_was_there_and_what_it_holds(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("kept")
    with pytest.raises(ConfigError):
        TieredCache(make_config(mine, nvme_bytes=HUGE))
    assert (mine / "notes.txt").read_text() == "kept"

    store = tmp_path / "store"
    with TieredCache(make_config(store, host_bytes=0, nvme_bytes=MiB)) as cache:
        cache.put("k", torch.arange(1000, dtype=torch.int32))
    with pytest.raises(ConfigError):
        TieredCache(make_config(store, host_bytes=0, nvme_bytes=HUGE))
    with TieredCache(make_config(store, host_bytes=0, nvme_bytes=MiB)) as cache:
        assert torch.equal(cache.get("k"), torch.arange(1000, dtype=torch.int32))


def test_an_open_refused_because_another_cache_holds_the_store_removes_nothing(tmp_path):
    path = tmp_path / "nvme"
    with TieredCache(make_config(path, host_bytes=0, nvme_bytes=MiB)) as cache:
        cache.put("k", torch.ones(100))
        with pytest.raises(StoreLockedError):
            TieredCache(make_config(path, host_bytes=0, nvme_bytes=MiB))
        assert torch.equal(cache.get("k"), torch.ones(100))
    assert (path / "ectier.lock").exists() and (path / "lmdb").is_dir()
