"""The daemon's lifecycle: start, stop, restart, crash. A daemon killed with ``kill -9`` mid-put
serves its committed entries after a restart; SIGTERM flushes; clients fail fast while it is down
and reconnect (and remap a new arena) when it is back; stale sockets and arenas of dead daemons
are reclaimed, live ones and foreign files never touched; ``ectier serve`` start-up errors are
one line. Helpers: tests/daemon_helpers.py.

Daemons:
- ``main``: 32 MiB host, NVMe, metrics on an ephemeral port, 64 KiB frame cap, lease 30 s (only
  for "a second daemon on its socket").
- one-off daemon processes for kill -9 / SIGTERM restarts (the ``process_daemon`` fixture), and
  servers in a thread of this process (``thread_daemon``) where a test looks inside one; both
  live in a ``daemon_dir`` and are stopped after the test (tests/conftest.py).
"""

from __future__ import annotations

import os
import stat
import subprocess
import time

import pytest
import torch
from click.testing import CliRunner

from daemon_helpers import (
    KiB,
    MiB,
    PYTHON,
    assert_same,
    clean_env,
    daemon_config,
    daemon_stats,
    make_tensor,
    raw_bytes,
    spec_digest,
    tensor_digest,
    wait_for,
    write_arena,
    write_config,
)
from ectier import CacheConfig, testing_daemon
from ectier.cli import main as cli_main
from ectier.daemon.client import DaemonClient, DaemonUnavailableError
from ectier.daemon.server import DaemonServer
from ectier.errors import EctierError


# ====================================================================== daemon crash/restart


DURABLE = [
    ("d-bf16", 201, "bfloat16", (37, 8192)),
    ("d-fp32", 202, "float32", (1000, 3)),
    ("d-int8", 203, "int8", (4 * MiB,)),
    ("d-empty", 204, "bfloat16", (0, 8192)),
]


def test_daemon_killed_mid_put_serves_committed_entries_after_restart(daemon_dir, process_daemon):
    d = daemon_dir
    cfg = daemon_config(d, write_through=True, host_bytes=16 * MiB)
    path = write_config(os.path.join(d, "cfg.json"), cfg)
    sock = cfg["daemon"]["socket_path"]
    first = process_daemon(path, sock).start()
    with DaemonClient(sock, connect_retry_s=10) as c:
        for key, seed, dtype, shape in DURABLE:
            c.put(key, make_tensor(seed, dtype, shape))
        assert c.stats()["tiers"]["nvme"]["entries"] == len(DURABLE)  # written through
        r = c.call("reserve", key="uncommitted", dtype="uint8", shape=[MiB])
        old_arena = c.server_info["arena"]["path"]
        write_arena(old_arena, r["extents"], b"\xcd" * (MiB // 2))  # half written
        first.kill9()
        assert stat.S_ISSOCK(os.stat(sock).st_mode)  # a stale socket file is left behind

        process_daemon(path, sock).start()  # same socket path, same NVMe store
        with DaemonClient(sock) as fresh:
            for spec in DURABLE:
                got = fresh.get(spec[0])
                assert got is not None and tensor_digest(got) == spec_digest(spec), spec[0]
            assert not fresh.contains("uncommitted")
            assert fresh.get("uncommitted") is None
            # the client that lost its daemon reconnects by itself
            assert tensor_digest(c.get("d-bf16")) == spec_digest(DURABLE[0])
            # the dead daemon's arena file does not leak (it would hold host.capacity_bytes of RAM in /dev/shm)
            assert not os.path.exists(old_arena)
            arenas = [f for f in os.listdir(d) if f.endswith(".arena")]
            assert arenas == [os.path.basename(fresh.server_info["arena"]["path"])]


def test_sigterm_flushes_and_the_same_client_reconnects(daemon_dir, process_daemon):
    d = daemon_dir
    cfg = daemon_config(d, write_through=False, flush_on_close=True)
    path = write_config(os.path.join(d, "cfg.yaml"), cfg)
    sock = cfg["daemon"]["socket_path"]
    first = process_daemon(path, sock).start()
    with DaemonClient(sock, connect_retry_s=30) as c:
        for key, seed, dtype, shape in DURABLE:
            c.put(key, make_tensor(seed, dtype, shape))
        assert c.stats()["tiers"]["nvme"]["entries"] == 0  # host only: only the flush saves them
        arena = c.server_info["arena"]["path"]

        assert first.terminate() == 0
        assert not os.path.exists(sock)
        assert not os.path.exists(arena)
        assert "Traceback" not in first.log()

        # the next call waits for the new daemon (connect_retry_s) and goes on with the same object
        second = process_daemon(path, sock).launch()
        assert c.contains("d-bf16")
        for spec in DURABLE:
            got = c.get(spec[0])
            assert got is not None and tensor_digest(got) == spec_digest(spec), spec[0]
        assert c.server_info["arena"]["path"] != arena
        t = make_tensor(205, "float16", (33, 77))
        c.put("after-restart", t)
        assert_same(c.get("after-restart"), t)
        assert second.terminate() == 0


def test_client_of_an_unreachable_daemon_fails_fast_then_reconnects(daemon_dir, thread_daemon):
    """A daemon that is down (or a wrong socket path) costs one connect_retry_s wait, not one per
    call: after a failed attempt calls raise at once for backoff_s, then each makes one immediate
    attempt; a daemon that comes up is used by the first call after the window."""
    d = daemon_dir
    # connect_retry_s 1.5 s: the bounds below for calls that must not wait (1 s) leave a loaded
    # machine room, and still fail a call that waits connect_retry_s
    with DaemonClient(os.path.join(d, "d.sock"), connect_retry_s=1.5, backoff_s=2.0) as c:
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailableError, match="cannot reach"):
            c.contains("k")
        assert 1.4 <= time.monotonic() - t0 < 6.0  # the one wait
        assert c.unreachable
        t0 = time.monotonic()
        for i in range(50):
            with pytest.raises(DaemonUnavailableError, match="cannot reach"):
                c.contains(f"k{i}") if i % 2 else c.put(f"k{i}", torch.zeros(4, dtype=torch.uint8))
        assert time.monotonic() - t0 < 1.0  # no waits, no attempts
        time.sleep(max(0.0, t0 + 2.1 - time.monotonic()))  # past backoff_s
        c.backoff_s = 60.0  # the next window outlasts the daemon's start below, however slow
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailableError):
            c.stats()  # window over: one immediate attempt, no connect_retry_s wait
        assert time.monotonic() - t0 < 1.0

        # a start-up probe: one attempt, no wait; a failure opens the window too
        probe = DaemonClient(os.path.join(d, "d.sock"), connect_retry_s=5.0)
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailableError):
            probe.connect(wait=False)
        with pytest.raises(DaemonUnavailableError):
            probe.contains("k")
        assert time.monotonic() - t0 < 2.0 and probe.unreachable  # (connect_retry_s: 5 s)
        probe.close()

        thread_daemon(CacheConfig.from_dict(daemon_config(d, nvme=False, host_bytes=4 * MiB)))
        with pytest.raises(DaemonUnavailableError):
            c.contains("k")  # still inside the window opened by the last failure
        c.backoff_s = 0.2
        time.sleep(0.3)
        c.put("k", torch.ones(8, dtype=torch.uint8))  # the first call after the window connects
        assert not c.unreachable and c.contains("k")


def test_client_lets_go_of_a_stopped_daemons_arena_at_its_next_call(daemon_dir, thread_daemon):
    """A client idle across a daemon stop keeps the old (unlinked) arena mapped, so its pages stay
    allocated in daemon.shm_dir; at its next call, which cannot reach the daemon, it unmaps it, so
    a restarted daemon finds room for its own arena."""
    d = daemon_dir
    cfg = CacheConfig.from_dict(daemon_config(d, nvme=False, host_bytes=4 * MiB))
    server, t = thread_daemon(cfg)
    with DaemonClient(cfg.daemon.socket_path, connect_retry_s=0.2, backoff_s=0.1) as c:
        c.put("a", make_tensor(1, "uint8", (64 * KiB,)))
        assert testing_daemon.arena_mapped(c)
        old_arena = server.arena_path
        server.stop()
        t.join(10)
        assert not os.path.exists(old_arena)
        with pytest.raises(DaemonUnavailableError):
            c.contains("a")
        assert not testing_daemon.arena_mapped(c), "the stopped daemon's arena is still mapped"
        thread_daemon(cfg)
        time.sleep(0.15)
        b = make_tensor(2, "uint8", (64 * KiB,))
        c.put("b", b)  # maps the new arena
        assert_same(c.get("b"), b)


def test_a_relative_shm_dir_reaches_clients_as_an_absolute_arena_path(monkeypatch, daemon_dir, thread_daemon):
    """daemon.shm_dir given relative to the daemon's working directory: a client running elsewhere
    must still map the arena (the daemon sends it an absolute path)."""
    d = daemon_dir
    os.mkdir(os.path.join(d, "shm"))
    monkeypatch.chdir(d)
    cfg = CacheConfig.from_dict(daemon_config(d, nvme=False, host_bytes=4 * MiB, shm_dir="shm"))
    server, _ = thread_daemon(cfg)
    assert os.path.isabs(server.arena_path) and os.path.dirname(server.arena_path) == os.path.join(d, "shm")
    monkeypatch.chdir("/")
    with DaemonClient(cfg.daemon.socket_path) as c:
        x = make_tensor(3, "uint8", (4 * KiB,))
        c.put("x", x)
        assert_same(c.get("x"), x)


def test_the_daemon_never_page_locks_its_arena_even_when_the_config_asks(caplog, daemon_dir, thread_daemon):
    """cudaHostRegister serves only the process that calls it, and would take GPU memory for a
    CUDA context in the daemon: ``host.pin_memory: true`` is not used there (told once, at INFO),
    neither refused (it was a ConfigError without CUDA) nor applied."""
    raw = daemon_config(daemon_dir, nvme=False, host_bytes=4 * MiB)
    raw["host"]["pin_memory"] = True
    cfg = CacheConfig.from_dict(raw)
    with caplog.at_level("INFO", logger="ectier.daemon"):
        thread_daemon(cfg)
    assert any("host.pin_memory" in r.getMessage() for r in caplog.records)
    with DaemonClient(cfg.daemon.socket_path) as c:
        x = make_tensor(4, "uint8", (64 * KiB,))
        c.put("x", x)
        assert_same(c.get("x"), x)
        assert c.stats()["tiers"]["host"]["pinned"] is False


def test_client_remaps_the_arena_when_a_restarted_daemon_reuses_its_path(daemon_dir, thread_daemon):
    """A daemon that restarts with the same pid (PID 1 of a container) creates its arena under the
    same file name: the client must map the new file, not keep writing into the old one."""
    cfg = CacheConfig.from_dict(daemon_config(daemon_dir, nvme=False, host_bytes=4 * MiB))
    s1, t1 = thread_daemon(cfg)
    with DaemonClient(cfg.daemon.socket_path, connect_retry_s=5) as c:
        c.put("a", make_tensor(1, "uint8", (1000,)))
        s1.stop()
        t1.join(10)
        s2, _ = thread_daemon(cfg)
        assert s2.arena_path == s1.arena_path  # same process, same name
        b = make_tensor(2, "uint8", (64 * KiB,))
        c.put("b", b)  # through a reconnect
        lease = s2.cache.acquire("b")
        try:
            arena = s2.cache.host_arena
            stored = b"".join(arena[o:o + n].numpy().tobytes() for o, n in lease.extents)
        finally:
            s2.cache.release(lease)
        assert stored == raw_bytes(b)
        with DaemonClient(cfg.daemon.socket_path) as other:
            assert_same(other.get("b"), b)
            assert_same(c.get("b"), b)


# ===================================================================== start-up and shutdown


def test_a_file_that_is_not_a_socket_is_never_deleted(daemon_dir):
    precious = os.path.join(daemon_dir, "precious.txt")
    with open(precious, "w") as f:
        f.write("keep me")
    cfg = CacheConfig.from_dict(daemon_config(daemon_dir, nvme=False, host_bytes=1 * MiB, socket_path=precious))
    server = DaemonServer(cfg)
    try:
        with pytest.raises(EctierError, match="socket_path"):
            server.start()
    finally:
        if server.listening:  # started after all: clean up
            server.stop()
            server.serve_forever()  # stopped: shuts down at once
    with open(precious) as f:
        assert f.read() == "keep me"


def test_stale_arenas_are_reclaimed_and_live_ones_kept(daemon_dir, thread_daemon):
    d = daemon_dir
    held = None
    try:
        uid = os.getuid()
        gone = [subprocess.Popen(["true"]) for _ in range(2)]
        for g in gone:
            g.wait()
        dead, dead2 = (g.pid for g in gone)  # pids that no longer run
        paths = {
            # a crashed earlier incarnation with this very name (a PID-1 daemon restarted)
            "mine": os.path.join(d, f"ectier-{uid}-{os.getpid()}.arena"),
            "dead": os.path.join(d, f"ectier-{uid}-{dead}.arena"),
            "dead-but-locked": os.path.join(d, f"ectier-{uid}-{dead2}.arena"),
            "live-pid": os.path.join(d, f"ectier-{uid}-1.arena"),  # pid 1 runs: never touched
            "dead-scratch": os.path.join(d, f"ectier-{uid}-{dead}.scratch-7"),  # a dead daemon's direct put
            "live-scratch": os.path.join(d, f"ectier-{uid}-1.scratch-2"),
            "other-user": os.path.join(d, f"ectier-{uid + 1}-{dead}.arena"),
            "unrelated": os.path.join(d, "ectier-notes.txt"),
        }
        for p in paths.values():
            with open(p, "wb") as f:
                f.write(b"old")
        import fcntl

        held = os.open(paths["dead-but-locked"], os.O_RDONLY)
        fcntl.flock(held, fcntl.LOCK_EX)  # as a live daemon holds its arena
        cfg = CacheConfig.from_dict(daemon_config(d, nvme=False, host_bytes=1 * MiB))
        server, _ = thread_daemon(cfg)
        assert server.arena_path == paths["mine"]
        assert os.path.getsize(paths["mine"]) == 1 * MiB  # created afresh
        assert not os.path.exists(paths["dead"]) and not os.path.exists(paths["dead-scratch"])
        for name in ("dead-but-locked", "live-pid", "live-scratch", "other-user", "unrelated"):
            assert os.path.exists(paths[name]), name
    finally:
        if held is not None:
            os.close(held)


def test_sigterm_right_after_the_socket_appears_still_cleans_up(daemon_dir, process_daemon):
    d = daemon_dir
    cfg = daemon_config(d, nvme=False, host_bytes=4 * MiB, metrics_port=0)
    sock = cfg["daemon"]["socket_path"]
    proc = process_daemon(write_config(os.path.join(d, "cfg.json"), cfg), sock).launch()
    wait_for(lambda: os.path.exists(sock) or proc.proc.poll() is not None, timeout=30, interval=0.001,
             what="the socket file")
    assert proc.terminate() == 0, proc.log()
    assert not os.path.exists(sock)
    assert [f for f in os.listdir(d) if f.endswith(".arena")] == []


def test_second_daemon_on_a_live_socket_exits_cleanly(main_daemon):
    r = subprocess.run([PYTHON, "-m", "ectier.daemon", "--config", main_daemon.config_path],
                       capture_output=True, text=True, timeout=60, env=clean_env())
    assert r.returncode == 1, r.stderr
    assert "already listening" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert daemon_stats(main_daemon.socket_path)["namespace"] == "test"  # the first one is untouched


def test_serve_with_a_bad_config_is_a_usage_error(daemon_dir):
    path = write_config(os.path.join(daemon_dir, "bad.json"), {"daemon": {"lease_s": -1}})
    r = CliRunner().invoke(cli_main, ["serve", "--config", path])
    assert r.exit_code == 2
    assert "daemon.lease_s" in r.output and "Traceback" not in r.output


def test_serve_errors_are_clean(monkeypatch, daemon_dir):
    """Start-up failures of `ectier serve` are one line naming the field, exit 1, no traceback,
    and leave no signal handler behind (run_daemon installs them before start())."""
    import signal

    d = daemon_dir
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    runner = CliRunner()
    cfg = daemon_config(d, nvme=False, host_bytes=1 * MiB, shm_dir=os.path.join(d, "no", "such", "dir"))
    r = runner.invoke(cli_main, ["serve", "--config", write_config(os.path.join(d, "a.json"), cfg)])
    assert r.exit_code == 1, r.output
    assert "daemon.shm_dir" in r.output and "Traceback" not in r.output
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    with open(os.path.join(d, "afile"), "w") as f:
        f.write("x")
    cfg = daemon_config(d, nvme=False, host_bytes=1 * MiB, socket_path=os.path.join(d, "afile", "s", "d.sock"))
    r = runner.invoke(cli_main, ["serve", "--config", write_config(os.path.join(d, "b.json"), cfg)])
    assert r.exit_code == 1, r.output
    assert "daemon.socket_path" in r.output and "Traceback" not in r.output
    assert [f for f in os.listdir(d) if f.endswith(".arena")] == []


def test_serve_with_its_metrics_port_taken_is_one_line_and_leaves_nothing_behind(daemon_dir):
    """A metrics port already in use: exit 1 naming daemon.metrics_port, no traceback, and no
    arena file or socket left in the directory (the arena holds RAM in /dev/shm)."""
    import socket as socket_mod

    d = daemon_dir
    taken = socket_mod.socket(socket_mod.AF_INET, socket_mod.SOCK_STREAM)
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        cfg = daemon_config(d, nvme=False, host_bytes=1 * MiB, metrics_port=port)
        r = CliRunner().invoke(cli_main, ["serve", "--config", write_config(os.path.join(d, "m.json"), cfg)])
        assert r.exit_code == 1, r.output
        assert "daemon.metrics_port" in r.output and str(port) in r.output
        assert "Traceback" not in r.output
        assert sorted(os.listdir(d)) == ["m.json"], "a failed start left files behind"
    finally:
        taken.close()


def test_serve_with_a_metrics_host_not_of_this_machine_names_metrics_host(daemon_dir):
    """An address this host does not have (TEST-NET-1, nothing is sent: the bind fails locally)
    is blamed on daemon.metrics_host, not on the port; nothing is left behind."""
    d = daemon_dir
    cfg = daemon_config(d, nvme=False, host_bytes=1 * MiB, metrics_port=0, metrics_host="192.0.2.1")
    r = CliRunner().invoke(cli_main, ["serve", "--config", write_config(os.path.join(d, "m.json"), cfg)])
    assert r.exit_code == 1, r.output
    assert "daemon.metrics_host" in r.output and "192.0.2.1" in r.output
    assert "daemon.metrics_port:" not in r.output and "Traceback" not in r.output
    assert sorted(os.listdir(d)) == ["m.json"], "a failed start left files behind"
