"""``ectier serve`` start-up as an operator sees it: a start that fails leaves no directory it
created behind (the socket's parents), a socket path or ``nvme.path`` given relative to the
daemon's working directory is logged and reported absolute (a client elsewhere needs the whole
path), and SIGHUP stops it cleanly.
Helpers: tests/daemon_helpers.py; the ``daemon_dir``, ``thread_daemon`` and ``process_daemon``
fixtures (tests/conftest.py) stop their daemons and remove their directory after each test."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess

import pytest
import torch
from click.testing import CliRunner

from daemon_helpers import ECTIER_SCRIPT, MiB, clean_env, daemon_config, wait_for, write_config
from ectier import CacheConfig
from ectier.cli import main as cli_main
from ectier.daemon.client import DaemonClient


def _serve(directory: str, cfg: dict) -> tuple[int, str]:
    r = CliRunner().invoke(cli_main, ["serve", "--config", write_config(os.path.join(directory, "c.json"), cfg)])
    return r.exit_code, r.output


def test_a_start_failing_on_the_metrics_port_removes_the_socket_directories_it_created(daemon_dir):
    d = daemon_dir
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        sock = os.path.join(d, "run", "ectier", "d.sock")
        code, out = _serve(d, daemon_config(d, nvme=False, host_bytes=1 * MiB, socket_path=sock,
                                            metrics_port=taken.getsockname()[1]))
        assert code == 1 and "daemon.metrics_port" in out, out
        assert sorted(os.listdir(d)) == ["c.json"], "a failed start left directories behind"
        cfg = daemon_config(d, nvme=True, host_bytes=1 * MiB, metrics_port=taken.getsockname()[1])
        cfg["nvme"]["path"] = os.path.join(d, "store")
        code, out = _serve(d, cfg)  # the port is tried first: no NVMe store was created either
        assert code == 1 and "nvme tier: opened" not in out and sorted(os.listdir(d)) == ["c.json"], out
    finally:
        taken.close()


def test_a_start_failing_on_the_arena_removes_the_socket_directories_it_created(daemon_dir):
    d = daemon_dir
    sock = os.path.join(d, "run", "d.sock")
    code, out = _serve(d, daemon_config(d, nvme=False, host_bytes=1 * MiB, socket_path=sock,
                                        shm_dir=os.path.join(d, "no-such-shm")))
    assert code == 1 and "daemon.shm_dir" in out, out
    assert sorted(os.listdir(d)) == ["c.json"], "a failed start left directories behind"


def test_a_failed_start_keeps_directories_that_existed_or_were_written_into(daemon_dir):
    """Only what the start itself created, and only while empty, is removed."""
    d = daemon_dir
    os.mkdir(os.path.join(d, "run"))
    sock = os.path.join(d, "run", "new", "d.sock")
    code, out = _serve(d, daemon_config(d, nvme=False, host_bytes=1 * MiB, socket_path=sock,
                                        shm_dir=os.path.join(d, "no-such-shm")))
    assert code == 1, out
    assert sorted(os.listdir(d)) == ["c.json", "run"] and os.listdir(os.path.join(d, "run")) == []


def test_a_relative_socket_path_is_logged_and_reported_absolute(monkeypatch, caplog, daemon_dir, thread_daemon):
    d = daemon_dir
    monkeypatch.chdir(d)
    raw = daemon_config(d, nvme=True, host_bytes=4 * MiB, socket_path="rel.sock")
    raw["nvme"]["path"] = "relstore"
    cfg = CacheConfig.from_dict(raw)
    with caplog.at_level(logging.INFO, logger="ectier"):
        thread_daemon(cfg)
    where, store = os.path.join(d, "rel.sock"), os.path.join(d, "relstore")
    assert any(f"listening on {where} " in r.getMessage() and f"nvme {store};" in r.getMessage()
               for r in caplog.records), caplog.text
    with DaemonClient(where) as c:
        stats = c.stats()
        assert stats["daemon"]["socket"] == where and stats["tiers"]["nvme"]["path"] == store


def test_sighup_stops_the_daemon_cleanly_and_flushes(daemon_dir, process_daemon):
    """A foreground ``ectier serve`` whose terminal or ssh session closes gets SIGHUP: it used to
    die at once (exit 129), leaving its socket and arena and losing write-back entries."""
    d = daemon_dir
    first = None
    try:
        cfg = daemon_config(d, nvme=True, host_bytes=4 * MiB)
        sock = cfg["daemon"]["socket_path"]
        # SIGHUP at its default, as in a terminal (this test may itself run under nohup, which the
        # daemon keeps: test_under_nohup_sighup_leaves_the_daemon_running)
        first = subprocess.Popen([ECTIER_SCRIPT, "serve", "--config", write_config(os.path.join(d, "cfg.json"), cfg)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=clean_env(),
                                 preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
        wait_for(lambda: os.path.exists(sock) or first.poll() is not None, 30, what="the socket")
        with DaemonClient(sock) as c:
            c.put("kept", torch.arange(1000, dtype=torch.int32))  # write-back: only in the arena
        first.send_signal(signal.SIGHUP)
        assert first.wait(30) == 0
        assert not os.path.exists(sock) and [f for f in os.listdir(d) if f.endswith(".arena")] == []
        process_daemon(os.path.join(d, "cfg.json"), sock).start()
        with DaemonClient(sock) as c:
            assert torch.equal(c.get("kept"), torch.arange(1000, dtype=torch.int32))
    finally:
        if first is not None and first.poll() is None:
            first.kill()


def test_under_nohup_sighup_leaves_the_daemon_running(daemon_dir):
    """``nohup ectier serve &`` is meant to outlive its session: an ignored SIGHUP stays ignored."""
    d = daemon_dir
    proc = None
    try:
        cfg = daemon_config(d, nvme=False, host_bytes=1 * MiB)
        sock = cfg["daemon"]["socket_path"]
        proc = subprocess.Popen(["nohup", ECTIER_SCRIPT, "serve", "--config", write_config(os.path.join(d, "c.json"), cfg)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=clean_env(), cwd=d)
        wait_for(lambda: os.path.exists(sock) or proc.poll() is not None, 30, what="the socket")
        proc.send_signal(signal.SIGHUP)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(1.5)
        with DaemonClient(sock) as c:
            assert c.stats()["daemon"]["socket"] == sock
        proc.terminate()
        assert proc.wait(30) == 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()


def test_an_arena_on_a_disk_filesystem_is_warned_about(caplog, daemon_dir, thread_daemon):
    """``daemon.shm_dir`` on ext4 & co. works, but the arena is then a disk file the kernel writes
    back (a newcomer ran a whole session so, told nothing)."""
    from ectier.tiers.storedir import mount_of

    cases = [("/dev/shm", False)] if os.path.isdir("/dev/shm") and mount_of("/dev/shm").fstype == "tmpfs" else []
    d = daemon_dir
    if mount_of(d).fstype not in ("tmpfs", "ramfs"):
        cases.append((d, True))
    if not cases:
        pytest.skip("no tmpfs at /dev/shm and /tmp in memory")
    for shm_dir, warned in cases:
        caplog.clear()
        cfg = CacheConfig.from_dict(daemon_config(d, nvme=False, host_bytes=1 * MiB, shm_dir=shm_dir))
        with caplog.at_level(logging.WARNING, logger="ectier.daemon"):
            server, t = thread_daemon(cfg)
        server.stop()
        t.join(10)
        lines = [r.getMessage() for r in caplog.records if "not in memory" in r.getMessage()]
        assert len(lines) == int(warned) and all("daemon.shm_dir" in x and "/dev/shm" in x for x in lines), lines


def test_a_second_daemon_with_the_same_config_is_told_a_daemon_listens_not_the_port(daemon_dir, thread_daemon):
    """Started twice with one config (a fixed metrics port), the second is told the socket is
    live, as before the metrics port was bound first (review, 2026-12-07)."""
    d = daemon_dir
    raw = daemon_config(d, nvme=False, host_bytes=1 * MiB, metrics_port=0)
    server, _ = thread_daemon(CacheConfig.from_dict(raw))
    raw["daemon"]["metrics_port"] = server.metrics_address[1]
    code, out = _serve(d, raw)
    assert code == 1 and "already listening" in out and "metrics_port" not in out, out


@pytest.mark.parametrize("under", ["", "deeper"])
def test_a_socket_path_under_a_file_says_which_path_is_not_a_directory(daemon_dir, under):
    d = daemon_dir
    blocker = os.path.join(d, "a-file")
    with open(blocker, "w") as f:
        f.write("not a directory")
    sock = os.path.join(blocker, under, "d.sock")
    code, out = _serve(d, daemon_config(d, nvme=False, host_bytes=1 * MiB, socket_path=sock))
    assert code == 1 and "daemon.socket_path" in out, out
    assert f"{blocker!r} is not a directory" in out, out
    assert "File exists" not in out, out
