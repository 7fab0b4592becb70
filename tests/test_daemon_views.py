"""Zero-copy views of the daemon's arena (``DaemonClient.get_view``, process-held leases).

A view's pin belongs to the client process: it outlives ``daemon.lease_s`` and the connection
(idle close, reconnect), its bytes stay the entry's while the arena churns, it is released once
the view's storage is freed (by the background releaser) or the process dies (SIGKILL), and one
process may pin at most ``daemon.view_pin_bytes`` through views (beyond: a copy, counted).
Every daemon is a real process (tests/daemon_helpers.py).
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from daemon_helpers import (
    KiB,
    MiB,
    DaemonProcess,
    assert_same,
    daemon_config,
    daemon_stats,
    make_tensor,
    remove_dir,
    short_tmpdir,
    wait_for,
    write_config,
)
from ectier.daemon.client import DaemonClient
from ectier.daemon.client_views import releaser_for

ITEM = (64, 8192)  # bfloat16: 1 MiB


def _start(directory: str, **kw) -> DaemonProcess:
    daemon = {k: kw.pop(k) for k in list(kw) if k in ("lease_s", "idle_timeout_s", "view_pin_bytes")}
    cfg = daemon_config(directory, **kw, **daemon)
    return DaemonProcess(write_config(os.path.join(directory, "daemon.json"), cfg), cfg["daemon"]["socket_path"]).start()


@pytest.fixture
def tmp_daemon():
    started: list[tuple[DaemonProcess, str]] = []

    def start(**kw) -> DaemonProcess:
        d = short_tmpdir()
        proc = _start(d, **kw)
        started.append((proc, d))
        return proc

    yield start
    for proc, d in started:
        proc.stop()
        remove_dir(d)


def _views(socket_path: str) -> dict:
    return daemon_stats(socket_path)["daemon"]["views"]


def _released(socket_path: str, client: DaemonClient) -> None:
    """Wait until this process's releaser sent everything queued (the view's storage is gone)."""
    gc.collect()
    assert releaser_for(client.socket_path, client.timeout_s).flush(10.0)


def test_a_view_outlives_the_lease_deadline_and_reconnects_and_keeps_its_bytes_under_eviction(tmp_daemon):
    proc = tmp_daemon(host_bytes=4 * MiB, lease_s=0.3, idle_timeout_s=0.2)
    original = make_tensor(1, "bfloat16", ITEM)
    with DaemonClient(proc.socket_path, client_name="viewer") as c:
        c.put("v", original)
        view = c.get_view("v")
        assert_same(view, original)
        assert _views(proc.socket_path)["leases"] == 1
        time.sleep(1.0)  # past lease_s (the reaper runs every 0.075 s) and idle_timeout_s: connection closed
        # (waited for: on a loaded machine the daemon's connection thread may not have run yet)
        s = wait_for(lambda: (d := daemon_stats(proc.socket_path)["daemon"])["idle_closed"] >= 1
                     and "viewer" not in {x["name"] for x in d["clients"]} and d, what="the idle connection closed")
        assert s["leases_expired"] == 0
        # the client reconnects by itself; churn the arena: overwrite the key, evict everything else
        c.put("v", make_tensor(2, "bfloat16", ITEM))
        for i in range(12):
            c.put(f"churn-{i}", make_tensor(10 + i, "bfloat16", ITEM))
        c.delete("v")
        c.close()
        with DaemonClient(proc.socket_path) as other:  # a fresh connection of the same process
            for i in range(12, 20):
                other.put(f"churn-{i}", make_tensor(10 + i, "bfloat16", ITEM))
        assert_same(view, original)
        assert _views(proc.socket_path)["leases"] == 1


def test_freeing_a_view_releases_its_pin_and_the_entry_becomes_evictable(tmp_daemon):
    proc = tmp_daemon(host_bytes=4 * MiB, nvme=False)
    first = make_tensor(3, "bfloat16", ITEM)
    with DaemonClient(proc.socket_path) as c:
        c.put("pinned", first)
        view = c.get_view("pinned")
        part = view[3:9].reshape(-1)  # a slice keeps the one storage, and so the pin
        del view
        _released(proc.socket_path, c)
        assert _views(proc.socket_path)["leases"] == 1
        for i in range(6):  # 4 MiB arena: only the pinned entry survives the churn
            c.put(f"churn-{i}", make_tensor(20 + i, "bfloat16", ITEM))
        assert c.contains("pinned")
        assert_same(part, first[3:9].reshape(-1))
        del part
        _released(proc.socket_path, c)
        v = _views(proc.socket_path)
        assert v["leases"] == 0 and v["bytes"] == 0 and v["released"] == 1
        assert daemon_stats(proc.socket_path)["daemon"]["leases"] == {"put": 0, "get": 0}
        for i in range(6, 12):
            c.put(f"churn-{i}", make_tensor(20 + i, "bfloat16", ITEM))
        assert not c.contains("pinned")  # evicted once unpinned (no NVMe tier)


def test_the_pins_of_a_killed_client_process_are_released(tmp_daemon):
    proc = tmp_daemon(host_bytes=8 * MiB, nvme=False)
    with DaemonClient(proc.socket_path) as c:
        c.put("a", make_tensor(4, "bfloat16", ITEM))
        c.put("b", make_tensor(5, "bfloat16", ITEM))
    child = textwrap.dedent(f"""
        import sys, time
        from ectier.daemon.client import DaemonClient
        c = DaemonClient({proc.socket_path!r})
        views = [c.get_view("a"), c.get_view("b")]
        states, pins, instance = c.prefetch_and_pin(["a"], ["a"])
        assert pins[0] is not None
        c.close()  # no connection left: only the process holds the pins
        print("holding", flush=True)
        time.sleep(600)
    """)
    kid = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, env={**os.environ})
    try:
        assert kid.stdout.readline().strip() == b"holding"
        v = _views(proc.socket_path)
        assert v["leases"] == 3 and v["processes"] == 1 and v["bytes"] == 2 * MiB
        os.kill(kid.pid, signal.SIGKILL)
        kid.wait(10)
    finally:
        if kid.poll() is None:
            kid.kill()
            kid.wait(10)
    v = wait_for(lambda: (s := _views(proc.socket_path))["leases"] == 0 and s, what="the dead client's pins released")
    assert v["released_dead"] == 3 and v["processes"] == 0


def test_one_process_pins_at_most_view_pin_bytes_then_copies(tmp_daemon):
    proc = tmp_daemon(host_bytes=8 * MiB, nvme=False, view_pin_bytes="2MiB")
    items = {k: make_tensor(30 + i, "bfloat16", ITEM) for i, k in enumerate("xyz")}
    with DaemonClient(proc.socket_path) as c:
        for k, t in items.items():
            c.put(k, t)
        vx, vy = c.get_view("x"), c.get_view("y")
        again = c.get_view("x")  # the same entry again pins no more of the arena
        vz = c.get_view("z")  # over the bound: a copy
        assert c.view_refusals == 1
        v = _views(proc.socket_path)
        assert v["leases"] == 3 and v["bytes"] == 2 * MiB and v["refused"] == 1 and v["limit_bytes"] == 2 * MiB
        for got, k in ((vx, "x"), (vy, "y"), (again, "x"), (vz, "z")):
            assert_same(got, items[k])
        assert daemon_stats(proc.socket_path)["daemon"]["leases"]["get"] == 3  # the copy's lease is gone
        del vx, again
        _released(proc.socket_path, c)
        vz2 = c.get_view("z")  # room again
        assert c.view_refusals == 1 and _views(proc.socket_path)["leases"] == 2
        assert_same(vz2, items["z"])


def test_views_off_and_entries_in_scratch_files_copy(tmp_daemon):
    proc = tmp_daemon(host_bytes=2 * MiB, view_pin_bytes=0)
    small, big = make_tensor(40, "bfloat16", ITEM), make_tensor(41, "bfloat16", (192, 8192))  # 3 MiB > arena
    with DaemonClient(proc.socket_path) as c:
        c.put("small", small)
        c.put("big", big)  # through a scratch file onto NVMe
        assert_same(c.get_view("small"), small)
        assert c.view_refusals == 1
        assert_same(c.get_view("big"), big)
        assert _views(proc.socket_path)["leases"] == 0


def test_a_release_for_an_earlier_daemon_run_is_dropped(tmp_daemon):
    proc = tmp_daemon(host_bytes=4 * MiB)
    first = make_tensor(50, "bfloat16", ITEM)
    with DaemonClient(proc.socket_path) as c:
        c.put("k", first)
        old = c.get_view("k")
        proc.terminate()
        proc.start()
        c.put("k", first)
        new = c.get_view("k")  # the restarted daemon may grant the same lease id
        del old  # its release names the first run: the new daemon ignores it
        _released(proc.socket_path, c)
        assert _views(proc.socket_path)["leases"] == 1
        assert_same(new, first)
        del new
        _released(proc.socket_path, c)
        assert _views(proc.socket_path)["leases"] == 0


def test_a_view_is_read_only():
    """The mapping under a view is PROT_READ: a write faults (in a child, which dies of SIGSEGV)
    instead of changing an entry every client shares."""
    d = short_tmpdir()
    proc = _start(d, host_bytes=4 * MiB, nvme=False)
    try:
        with DaemonClient(proc.socket_path) as c:
            c.put("ro", make_tensor(60, "bfloat16", ITEM))
        child = textwrap.dedent(f"""
            from ectier.daemon.client import DaemonClient
            v = DaemonClient({proc.socket_path!r}).get_view("ro")
            v[0, 0] = 1.0
        """)
        kid = subprocess.run([sys.executable, "-c", child], capture_output=True, timeout=60)
        assert kid.returncode == -signal.SIGSEGV, kid.stderr[-2000:]
        with DaemonClient(proc.socket_path) as c:
            assert_same(c.get("ro"), make_tensor(60, "bfloat16", ITEM))
    finally:
        proc.stop()
        remove_dir(d)


def test_view_pin_bounds_larger_than_the_arena_are_config_errors():
    from ectier.config import CacheConfig
    from ectier.daemon.server import view_pin_bounds
    from ectier.errors import ConfigError

    d = short_tmpdir()
    try:
        base = daemon_config(d, host_bytes=8 * MiB, nvme=False)
        for daemon, field in (({"view_pin_bytes": "16MiB"}, "daemon.view_pin_bytes"),
                              ({"view_pin_total_bytes": "9MiB"}, "daemon.view_pin_total_bytes"),
                              ({"view_pin_bytes": "4MiB", "view_pin_total_bytes": "2MiB"}, "daemon.view_pin_total_bytes")):
            with pytest.raises(ConfigError, match=field):  # when the config is built, not first at serve
                CacheConfig.from_dict({**base, "daemon": {**base["daemon"], **daemon}})
        assert not [n for n in os.listdir(d) if n.endswith(".arena")]  # refused before anything was made
        ok = CacheConfig.from_dict({**base, "daemon": {**base["daemon"], "view_pin_bytes": "4MiB"}})
        assert view_pin_bounds(ok) == (4 * MiB, 4 * MiB)  # per process; over all: max(per, half the arena)
    finally:
        remove_dir(d)


def test_two_processes_at_the_default_bound_cannot_fill_the_arena_between_them(tmp_daemon):
    """Default bounds: half the arena per process AND half of it over all processes, so a
    second process views only what the first left of that half (the rest it copies)."""
    proc = tmp_daemon(host_bytes=8 * MiB, nvme=False)
    items = {f"e{i}": make_tensor(60 + i, "bfloat16", ITEM) for i in range(6)}
    with DaemonClient(proc.socket_path) as c:
        for k, t in items.items():
            c.put(k, t)
        mine = [c.get_view(k) for k in ("e0", "e1", "e2")]  # 3 MiB of the 4 MiB
        assert c.view_refusals == 0
        child = textwrap.dedent(f"""
            from ectier.daemon.client import DaemonClient
            c = DaemonClient({proc.socket_path!r})
            views = [c.get_view(k) for k in ("e3", "e4", "e5")]
            assert all(v is not None for v in views)
            print(c.view_refusals, flush=True)
        """)
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, env={**os.environ}, timeout=60)
        assert out.returncode == 0, out.stderr.decode()
        assert out.stdout.strip() == b"2"  # 1 MiB more fit under the 4 MiB over all processes
        v = _views(proc.socket_path)
        assert v["total_limit_bytes"] == 4 * MiB and v["limit_bytes"] == 4 * MiB and v["refused"] == 2
        for got, k in zip(mine, ("e0", "e1", "e2")):
            assert_same(got, items[k])

