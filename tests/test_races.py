"""Races staged deterministically (events in hooks of internal methods), each ending in a checked
state: a get racing the eviction of the same key (host demotion in flight; NVMe eviction before
and inside the read), a delete racing a promotion, two threads putting one key with different sizes
(host/host and NVMe/host), and two client processes putting one key through the daemon.

Complements ``tests/test_concurrency.py`` (random stress; pinned slot vs eviction; late demotion vs
overwrite; NVMe read vs delete + rewrite). Two processes opening one NVMe directory directly: one
gets ``StoreLockedError`` (``tests/test_nvme_open.py::test_directory_held_by_another_process_is_locked``).

Versions decide: every put takes a write version when it starts; of two overlapping puts of one
key, the one that started later stands, whichever finishes last (both orders are linearizable).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from ectier import TieredCache
from ectier.tiers.host import HostTier
from ectier.tiers.nvme import NvmeTier

from conftest import KiB, MiB, assert_same, check_quiescent, digest, filled, host_holds, make_config, nvme_holds
from ectier import testing
from staged_threads import join, start

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Gate:
    """Stops the first call of a wrapped method that ``match(args)`` accepts until released."""

    def __init__(self, monkeypatch, cls, name, match):
        self.entered, self.release = threading.Event(), threading.Event()
        self.used = False
        original = getattr(cls, name)

        def wrapper(*args, **kwargs):
            if not self.used and match(*args, **kwargs):
                self.used = True
                self.entered.set()
                assert self.release.wait(30), "gate never released"
            return original(*args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    def wait(self):
        assert self.entered.wait(10), "the staged call never reached the gate"


# ============================================================================ get vs eviction


def test_get_racing_the_demotion_of_the_same_key(tmp_path, monkeypatch):
    """K is being evicted (its demotion write to NVMe held); get(K) meanwhile reads K from host;
    after the demotion get(K) is an NVMe hit, promoted."""
    kd = digest("K")
    gate = Gate(monkeypatch, NvmeTier, "write", lambda tier, d, rec: d == kd)
    cfg = make_config(tmp_path / "nvme", host_bytes=2 * 128 * KiB, nvme_bytes=2 * MiB,
                      write_behind_fraction=0)  # K's write is the eviction's
    with TieredCache(cfg) as cache:
        k, x, y = filled(128 * KiB, 1), filled(128 * KiB, 2), filled(128 * KiB, 3)
        cache.put("K", k)
        cache.put("X", x)
        p, pbox = start(cache.put, "Y", y)  # evicts K, the LRU: demotion held in NvmeTier.write
        gate.wait()
        assert_same(cache.get("K"), k)  # still in host, pinned by the demoter: served from there
        gate.release.set()
        join(p, pbox)
        assert nvme_holds(cache, "K")
        assert_same(cache.get("K"), k)
        assert_same(cache.get("X"), x) if cache.contains("X") else None
        assert_same(cache.get("Y"), y)
        check_quiescent(cache)


class _HeldReadEnv:
    """Proxy of the tier's LMDB environment: the getter's read transaction stops right after it
    began (its snapshot taken), until released; ``real`` is the wrapped environment."""

    def __init__(self, env):
        self.real = env
        self.begun, self.go = threading.Event(), threading.Event()

    def begin(self, *args, **kwargs):
        txn = self.real.begin(*args, **kwargs)
        # the getter's first read-only transaction: its read's index lookup (the read asks for no buffers)
        if threading.current_thread().name == "getter" and not kwargs.get("write") and not self.go.is_set():
            self.begun.set()
            assert self.go.wait(30)
        return txn

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("order", ["evicted-before-read", "evicted-inside-read"])
def test_get_racing_the_nvme_eviction_of_the_same_key(tmp_path, monkeypatch, order):
    """get(K) found K on NVMe; K is evicted from NVMe (budget) before its read transaction began
    (-> a miss) or after (-> K's bytes whole, from the snapshot). Either way the tier forgets K."""
    cfg = make_config(tmp_path / "nvme", host_bytes=0, nvme_bytes=3 * 100 * KiB + 200 * KiB)
    with TieredCache(cfg) as cache:
        k = filled(100 * KiB, 1)
        cache.put("K", k)  # the NVMe LRU
        cache.put("A", filled(100 * KiB, 2))
        cache.put("B", filled(100 * KiB, 3))
        nv = testing.tier(cache, "nvme")
        if order == "evicted-before-read":
            gate = Gate(monkeypatch, NvmeTier, "read", lambda tier, d, ns, key: key == "K")
        else:
            proxy = _HeldReadEnv(testing.lmdb_of(nv).env)
            testing.set_lmdb_env(nv, proxy)
        try:
            g, gbox = start(cache.get, "K", name="getter")
            if order == "evicted-before-read":
                gate.wait()
            else:
                assert proxy.begun.wait(10), "the getter's read transaction never began"
            for i in range(5):  # the get touched K: it is the LRU again after three more puts
                cache.put(f"new{i}", filled(100 * KiB, 4 + i))
                if not nvme_holds(cache, "K"):
                    break
            assert not nvme_holds(cache, "K")
            (gate.release.set() if order == "evicted-before-read" else proxy.go.set())
            got = join(g, gbox)
        finally:
            if order != "evicted-before-read":
                testing.set_lmdb_env(nv, proxy.real)
        if order == "evicted-before-read":
            assert got is None
        else:
            assert_same(got, k)
        assert not cache.contains("K") and cache.get("K") is None
        assert cache.stats()["tiers"]["nvme"]["checksum_failures"] == 0
        check_quiescent(cache)


# ============================================================================ delete vs promotion


@pytest.mark.parametrize("stage", ["during-host-copy", "during-nvme-read"])
def test_delete_racing_a_promotion(tmp_path, monkeypatch, stage):
    """get(K) promotes K from NVMe into host; delete(K) lands during the promotion's host copy
    (the get serves the bytes it read; the promotion must not resurrect K) or before its NVMe
    read (a miss)."""
    cfg = make_config(tmp_path / "nvme", host_bytes=2 * 128 * KiB, nvme_bytes=2 * MiB)
    with TieredCache(cfg) as cache:
        k = filled(128 * KiB, 1)
        cache.put("K", k)
        cache.put("X", filled(128 * KiB, 2))
        cache.put("Y", filled(128 * KiB, 3))  # K demoted to NVMe
        assert nvme_holds(cache, "K") and not host_holds(cache, "K")
        if stage == "during-host-copy":
            gate = Gate(monkeypatch, HostTier, "write", lambda tier, slot, src: slot.digest == digest("K"))
        else:
            gate = Gate(monkeypatch, NvmeTier, "read", lambda tier, d, ns, key: key == "K")
        g, gbox = start(cache.get, "K")
        gate.wait()
        assert cache.delete("K")
        gate.release.set()
        got = join(g, gbox)
        if stage == "during-host-copy":
            assert_same(got, k)  # read whole before the delete: ordered before it
        else:
            assert got is None
        assert not cache.contains("K") and cache.get("K") is None
        assert not host_holds(cache, "K") and not nvme_holds(cache, "K")
        assert cache.stats()["tiers"]["host"]["promotions"] == 0
        check_quiescent(cache)
    with TieredCache(cfg) as again:  # nor does a restart
        assert again.get("K") is None


# ============================================================================ same key, two threads


@pytest.mark.parametrize("first", ["small-host", "big-nvme"])
@pytest.mark.parametrize("finisher", ["first-finishes-last", "first-finishes-first"])
def test_two_threads_put_one_key_with_different_sizes(tmp_path, monkeypatch, first, finisher):
    """Thread 1 starts put(K) (held in its copy / NVMe write); thread 2 puts K with another size and
    dtype. The later-started put stands, in every tier, after a restart too, whatever finishes
    last; byte accounting stays exact."""
    cfg = make_config(tmp_path / "nvme", host_bytes=256 * KiB, nvme_bytes=4 * MiB, write_through=False)
    small = filled(64 * KiB, 1)
    big = torch.arange(100 * KiB, dtype=torch.float32)  # 400 KiB: larger than host, NVMe only
    v1, v2 = (small, big) if first == "small-host" else (big, small)
    kd = digest("K")
    if first == "small-host":
        gate = Gate(monkeypatch, HostTier, "write", lambda tier, slot, src: slot.digest == kd)
    else:
        gate = Gate(monkeypatch, NvmeTier, "write", lambda tier, d, rec: d == kd)
    with TieredCache(cfg) as cache:
        cache.put("other", filled(32 * KiB, 9))
        t1, b1 = start(cache.put, "K", v1)
        gate.wait()  # thread 1 has its version and is mid-copy
        if finisher == "first-finishes-first":
            gate.release.set()
            join(t1, b1)
        t2, b2 = start(cache.put, "K", v2)
        join(t2, b2)
        gate.release.set()
        join(t1, b1)
        assert_same(cache.get("K"), v2)
        assert_same(cache.get("other"), filled(32 * KiB, 9))
        assert len(cache) == 2
        check_quiescent(cache)
    with TieredCache(cfg) as again:  # flushed at close: the same winner after a restart
        assert_same(again.get("K"), v2)
        check_quiescent(again)


# ============================================================================ same key, two processes, one daemon


CHILD_CLIENT = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from daemon_helpers import make_tensor, write_arena
from ectier.daemon.client import DaemonClient
from ectier.tensors import byte_view
c = DaemonClient(sys.argv[1], client_name="racer-child")
lease = None
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "reserve":  # reserve KEY SEED NBYTES: reserve and write half the bytes
        t = make_tensor(int(args[1]), "uint8", (int(args[2]),))
        r = c.call("reserve", key=args[0], dtype="uint8", shape=[t.numel()])
        lease, extents = r["lease"], r["extents"]
        data = bytes(byte_view(t).numpy())
        write_arena(c.server_info["arena"]["path"], extents, data[: len(data) // 2])
    elif cmd == "commit":  # write the rest, commit
        write_arena(c.server_info["arena"]["path"], extents, data)
        c.call("commit", lease=lease)
    elif cmd == "put":  # put KEY SEED NBYTES
        c.put(args[0], make_tensor(int(args[1]), "uint8", (int(args[2]),)))
    print("ok", flush=True)
"""


@pytest.mark.parametrize("write_through", [False, True])
def test_get_while_an_overwrite_lands_on_nvme_directly_waits_for_it(tmp_path, write_through):
    """An entry larger than the host tier lives on NVMe only; its overwrite replaces the NVMe
    record before the new version becomes current. A get in that instant (held there by
    ``testing.hold_writes(after=True)``) waits for the put and returns its bytes: it answered a
    miss, for a key stored all along (``contains`` True), in ~0.1 % of gets under churn, and
    the daemon a ``hit: false``."""
    cfg = make_config(tmp_path / "nvme", host_bytes=256 * KiB, nvme_bytes=8 * MiB, write_through=write_through)
    with TieredCache(cfg) as c:
        c.put("k", filled(MiB, 1))
        assert nvme_holds(c, "k") and not host_holds(c, "k")
        new = filled(MiB, 2)
        with testing.hold_writes(c, "nvme", after=True) as gate:
            writer = start(c.put, "k", new)
            assert gate.wait_held(1)  # the new record is stored; the put has not finished
            t0 = time.monotonic()  # callers that take only what the host tier holds never wait
            assert c.acquire("k", promote=False) is None and c.acquire_many(["k"]) == [None]
            assert time.monotonic() - t0 < 0.5
            reader = start(c.get, "k")
            reader[0].join(0.3)
            assert reader[0].is_alive(), f"the get returned {reader[1]} before the put finished"
            gate.open()
            join(*writer)
            got = join(*reader)
        assert_same(got, new)
        assert c.contains("k")
        check_quiescent(c)


def test_two_processes_put_one_key_through_the_daemon():
    """A child process reserves K (half written); this process puts K with another size and
    commits; the child then commits. The later reservation stands (both orders are linearizable),
    the daemon stays consistent, and after a SIGKILL + restart (write-through) the same value is
    served. Then the roles swap."""
    from daemon_helpers import (DaemonProcess, daemon_config, make_tensor, remove_dir, short_tmpdir,
                                tensor_digest, write_config)
    from ectier.daemon.client import DaemonClient

    d = short_tmpdir()
    daemons, child, c = [], None, None
    try:
        cfg = daemon_config(d, host_bytes=8 * MiB, write_through=True)
        path = write_config(os.path.join(d, "cfg.json"), cfg)
        sock = cfg["daemon"]["socket_path"]
        daemons.append(DaemonProcess(path, sock).start())
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD_CLIENT), sock,
                                  os.path.join(REPO, "tests")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env)

        def tell(cmd):
            child.stdin.write(cmd + "\n")
            child.stdin.flush()
            line = child.stdout.readline()
            assert line.strip() == "ok", (cmd, line, child.stderr.read() if child.poll() is not None else "")

        c = DaemonClient(sock, client_name="racer-parent")
        # round 1: child reserves first, parent puts, child commits last -> the parent's value stands
        tell("reserve K 1 300000")
        mine = make_tensor(2, "uint8", (123457,))
        c.put("K", mine)
        tell("commit")
        assert tensor_digest(c.get("K")) == tensor_digest(mine)
        # round 2: parent reserves first (low level), child puts, parent commits last -> the child's
        r = c.call("reserve", key="K", dtype="uint8", shape=[777])
        tell("put K 3 200000")
        c.call("commit", lease=r["lease"])
        theirs = make_tensor(3, "uint8", (200000,))
        assert tensor_digest(c.get("K")) == tensor_digest(theirs)
        st = c.stats()
        assert st["entries"] == 1 and st["tiers"]["nvme"]["entries"] == 1
        assert st["daemon"]["leases"] == {"put": 0, "get": 0}
        daemons[0].kill9()
        daemons.append(DaemonProcess(path, sock).start())
        with DaemonClient(sock) as fresh:
            assert tensor_digest(fresh.get("K")) == tensor_digest(theirs)
    finally:
        if child is not None:
            child.kill()
            child.wait(10)
        if c is not None:
            c.close()
        for dp in daemons:
            dp.stop()
        remove_dir(d)
