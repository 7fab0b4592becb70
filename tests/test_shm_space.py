"""A host arena in a shm directory too small for it: refused at start-up, never a SIGBUS later.

A shared arena used to be a sparse file: ``ectier serve`` with ``host.capacity_bytes`` larger
than the free space of ``daemon.shm_dir`` started fine, and the first client whose write reached
past the tmpfs's free space died with SIGBUS (a vLLM worker, in EPD). These tests use a real
16 MiB tmpfs (skipped where mounting is refused: not root, no CAP_SYS_ADMIN).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from daemon_helpers import (
    KiB,
    MiB,
    ECTIER_SCRIPT,
    DaemonProcess,
    clean_env,
    daemon_config,
    remove_dir,
    short_tmpdir,
    write_config,
)
from fork_helpers import forked_python
from ectier import CacheConfig
from ectier.cache import TieredCache
from ectier.errors import ConfigError

TMPFS_BYTES = 16 * MiB


@pytest.fixture
def small_tmpfs():
    """A fresh 16 MiB tmpfs mount point (and a separate directory for sockets and configs)."""
    mnt = short_tmpdir()
    work = short_tmpdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", mnt],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        r = None
        why = str(exc)
    if r is None or r.returncode != 0:
        os.rmdir(mnt)
        remove_dir(work)
        pytest.skip(f"cannot mount a tmpfs here: {why if r is None else r.stderr.strip()}")
    try:
        yield mnt, work
    finally:
        subprocess.run(["umount", "-l", mnt], capture_output=True, timeout=30)
        os.rmdir(mnt)
        remove_dir(work)


def _cfg(mnt: str, work: str, host_bytes: int) -> dict:
    return daemon_config(work, nvme=False, host_bytes=host_bytes, block_bytes=64 * KiB,
                         shm_dir=mnt, socket_path=os.path.join(work, "d.sock"))


def test_serve_refuses_an_arena_larger_than_the_shm_dir(small_tmpfs):
    mnt, work = small_tmpfs
    path = write_config(os.path.join(work, "cfg.json"), _cfg(mnt, work, 64 * MiB))
    proc = subprocess.Popen([ECTIER_SCRIPT, "serve", "--config", path], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=clean_env(), stdin=subprocess.DEVNULL)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        # the old behaviour: a sparse 64 MiB arena on a 16 MiB tmpfs, and a daemon serving it
        proc.terminate()
        stdout, stderr = proc.communicate(timeout=30)
        raise AssertionError(f"ectier serve started with a 64 MiB arena on a 16 MiB tmpfs:\n{stderr}")
    out = stdout + stderr
    assert proc.returncode != 0, out
    assert "host.capacity_bytes" in out and "daemon.shm_dir" in out, out
    assert str(TMPFS_BYTES) in out, out  # the free bytes
    assert mnt in out, out
    assert "Traceback" not in out, out
    assert os.listdir(mnt) == []  # no partial arena file left behind
    assert not os.path.exists(os.path.join(work, "d.sock"))


def test_fallocate_enospc_is_the_same_clear_error_and_leaves_no_file(small_tmpfs, monkeypatch):
    """statvfs can be stale or lie (another process fills the tmpfs in between): the reservation
    itself failing with ENOSPC is reported the same way, and the partial file is removed."""
    mnt, work = small_tmpfs
    real = os.statvfs

    class _Roomy:
        def __init__(self, st):
            self.f_frsize = st.f_frsize
            self.f_bavail = 1 << 40

    monkeypatch.setattr(os, "statvfs", lambda p: _Roomy(real(p)))
    cfg = CacheConfig.from_dict(_cfg(mnt, work, 64 * MiB))
    with pytest.raises(ConfigError, match=r"host\.capacity_bytes.*daemon\.shm_dir"):
        TieredCache(cfg, host_shm_path=os.path.join(mnt, "x.arena"))
    assert os.listdir(mnt) == []


def test_tiered_cache_with_host_shm_path_checks_the_space_too(small_tmpfs):
    mnt, work = small_tmpfs
    cfg = CacheConfig.from_dict(_cfg(mnt, work, 64 * MiB))
    with pytest.raises(ConfigError, match=r"host\.capacity_bytes.*16777216"):
        TieredCache(cfg, host_shm_path=os.path.join(mnt, "x.arena"))
    assert os.listdir(mnt) == []
    # one that fits is reserved at once: its blocks are taken from the tmpfs before any write
    cfg = CacheConfig.from_dict(_cfg(mnt, work, 8 * MiB))
    cache = TieredCache(cfg, host_shm_path=os.path.join(mnt, "y.arena"))
    try:
        st = os.statvfs(mnt)
        assert st.f_bavail * st.f_frsize <= TMPFS_BYTES - 8 * MiB
    finally:
        cache.close()
    assert os.listdir(mnt) == []


_FILL_CLIENT = textwrap.dedent("""
    import sys, torch
    from ectier.daemon.client import DaemonClient
    sock, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    c = DaemonClient(sock, connect_retry_s=5)
    for i in range(n):
        c.put(f"k{i}", torch.full((size,), i + 1, dtype=torch.uint8))
    for i in range(n):
        got = c.get(f"k{i}")
        assert got is not None and bool((got == i + 1).all()), i
    st = c.stats()["tiers"]["host"]
    print("USED", st)
    c.close()
""")


def test_an_arena_that_fits_serves_puts_filling_it_even_when_the_tmpfs_fills_up(small_tmpfs):
    """The arena's pages are reserved at start: another tenant filling the rest of the tmpfs
    afterwards cannot turn a client's write into the arena into a SIGBUS."""
    mnt, work = small_tmpfs
    host = 12 * MiB
    cfg = _cfg(mnt, work, host)
    path = write_config(os.path.join(work, "cfg.json"), cfg)
    daemon = DaemonProcess(path, cfg["daemon"]["socket_path"]).start()
    try:
        # another tenant of the tmpfs takes every byte left
        with open(os.path.join(mnt, "filler"), "wb") as f:
            chunk = b"\xff" * MiB
            try:
                while True:
                    f.write(chunk)
                    f.flush()
            except OSError:
                pass
        n = host // MiB
        client = forked_python(["-c", _FILL_CLIENT, cfg["daemon"]["socket_path"], str(n), str(MiB)], stdout=True,
                               env=clean_env())
        try:
            out = client.stdout.read()
            rc = client.wait(120)
            assert rc == 0, f"client rc={rc} (-7 = SIGBUS):\n{out}\n{client.stderr_text()}\n{daemon.log()}"
        finally:
            client.close()
        assert "USED" in out
    finally:
        daemon.stop()
    assert "Traceback" not in daemon.log(), daemon.log()
