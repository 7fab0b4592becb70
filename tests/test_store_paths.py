"""Paths of a store as a user writes them, and a store directory that cannot be opened.

- A leading ``~`` in ``nvme.path``, ``daemon.socket_path`` or ``daemon.shm_dir`` is the home
  directory, as in a shell (it made a directory literally named ``~`` in the current one).
- A ``segment.0`` that is not a file is a ``StoreOpenError`` naming ``nvme.path`` (it was a raw
  ``IsADirectoryError``), and the process that saw it exits normally: the host arena's
  populating thread is ended by the failed open (the process was aborted at exit, status 134,
  "terminate called without an active exception").
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from ectier import TieredCache
from ectier.config import CacheConfig, DaemonConfig, NvmeTierConfig
from ectier.errors import StoreOpenError


def test_a_leading_tilde_is_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = CacheConfig.from_dict({"nvme": {"path": "~/store", "capacity_bytes": "8MiB"},
                                 "daemon": {"socket_path": "~/e.sock", "shm_dir": "~/shm"}})
    assert cfg.nvme.path == str(tmp_path / "store")
    assert cfg.daemon.socket_path == str(tmp_path / "e.sock") and cfg.daemon.shm_dir == str(tmp_path / "shm")
    assert NvmeTierConfig(path="~").path == str(tmp_path)
    assert DaemonConfig(socket_path="a/~b.sock").socket_path == "a/~b.sock"  # only a leading one
    with TieredCache(cfg) as cache:
        assert len(cache) == 0
    assert (tmp_path / "store" / "ectier.lock").exists() and not os.path.exists("~")


def test_a_segment_that_is_a_directory_is_a_store_open_error(tmp_path):
    (tmp_path / "store" / "segment.0").mkdir(parents=True)
    with pytest.raises(StoreOpenError, match=r"^nvme\.path: cannot open the store in .*segment\.0"):
        TieredCache(CacheConfig(nvme=NvmeTierConfig(path=str(tmp_path / "store"), capacity_bytes="8MiB")))


def test_a_process_exits_normally_after_a_failed_open(tmp_path):
    (tmp_path / "store" / "segment.0").mkdir(parents=True)
    script = textwrap.dedent(f"""
        from ectier import TieredCache
        from ectier.config import CacheConfig, HostTierConfig, NvmeTierConfig
        from ectier.errors import StoreOpenError
        try:
            TieredCache(CacheConfig(host=HostTierConfig(capacity_bytes="1GiB", pin_memory=False),
                                    nvme=NvmeTierConfig(path={str(tmp_path / "store")!r}, capacity_bytes="8MiB")))
        except StoreOpenError:
            print("refused")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "refused"
