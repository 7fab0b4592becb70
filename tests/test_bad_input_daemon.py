"""Bad input to the daemon protocol: valid requests mutated byte-wise get typed error replies only
(never ``InternalError``: that is an unexpected exception in a handler), the daemon's contents
unchanged. The atheris harness ``tools/fuzz_protocol.py`` (on demand) shares its oracle with the
smoke test here, which runs it without atheris. (The public API and config loaders:
test_bad_input.py.)"""

from __future__ import annotations

import os
import signal
import sys
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import KiB, MiB


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ============================================================================ daemon protocol


@pytest.fixture(scope="module")
def populated_daemon():
    from daemon_helpers import DaemonProcess, daemon_config, make_tensor, remove_dir, short_tmpdir, write_config
    from ectier.daemon.client import DaemonClient

    d = short_tmpdir()
    proc = None
    try:
        cfg = daemon_config(d, host_bytes=8 * MiB, write_through=True, max_frame_bytes=64 * KiB)
        proc = DaemonProcess(write_config(os.path.join(d, "cfg.json"), cfg), cfg["daemon"]["socket_path"]).start()
        specs = {f"stored-entry-number-{i}": make_tensor(40 + i, "bfloat16", (17 * (i + 1), 33)) for i in range(3)}
        with DaemonClient(proc.socket_path) as c:
            for k, t in specs.items():
                c.put(k, t)
        proc.specs = specs
        yield proc
    finally:
        if proc is not None:
            proc.stop()
        remove_dir(d)


def _daemon_contents(proc):
    from daemon_helpers import daemon_stats, tensor_digest
    from ectier.daemon.client import DaemonClient

    with DaemonClient(proc.socket_path) as c:
        got = {k: (None if (t := c.get(k)) is None else tensor_digest(t)) for k in proc.specs}
    st_ = daemon_stats(proc.socket_path)
    # (not host used_bytes: a mutated reserve may evict to make room; evicted entries stay on NVMe)
    return got, st_["entries"], st_["tiers"]["nvme"]["entries"], st_["tiers"]["nvme"]["used_bytes"]


BASE_REQUESTS = [
    {"id": 1, "op": "hello", "version": 1, "client": "fuzz"},
    {"id": 2, "op": "ping"},
    {"id": 3, "op": "get", "key": "stored-entry-number-0"},
    {"id": 4, "op": "contains", "key": "stored-entry-number-1", "namespace": "test"},
    {"id": 5, "op": "stats"},
    {"id": 6, "op": "reserve", "key": "zz", "dtype": "bfloat16", "shape": [3, 4]},
    {"id": 7, "op": "abort", "lease": 123456789},
    {"id": 8, "op": "release", "lease": 987654321},
    {"id": 9, "op": "delete", "key": "zz"},
    {"id": 10, "op": "get", "key": "zz", "namespace": "other"},
]


mutation = st.tuples(st.sampled_from(["flip", "insert", "delete", "truncate", "duplicate", "set"]),
                     st.integers(0, 1 << 16), st.integers(0, 255))


def _mutate(data: bytes, mutations) -> bytes:
    b = bytearray(data)
    for kind, pos, byte in mutations:
        if not b:
            break
        p = pos % len(b)
        if kind == "flip":
            b[p] ^= 1 << (byte % 8)
        elif kind == "set":
            b[p] = byte
        elif kind == "insert":
            b.insert(p, byte)
        elif kind == "delete":
            del b[p]
        elif kind == "truncate":
            del b[p:]
        elif kind == "duplicate":
            b[p:p] = b[p:p + 1 + byte % 8]
    return bytes(b)


def _frames(reqs) -> bytes:
    out = b""
    for r in reqs:
        body = msgpack.packb(r, use_bin_type=True)
        out += len(body).to_bytes(4, "big") + body
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(st.sampled_from(BASE_REQUESTS), min_size=1, max_size=3),
       mutations=st.lists(mutation, min_size=1, max_size=3))
def test_mutated_frames_get_typed_errors_and_change_nothing(populated_daemon, reqs, mutations):
    from daemon_helpers import RawConn

    before = _daemon_contents(populated_daemon)
    with RawConn(populated_daemon.socket_path, timeout=10) as raw:
        replies = raw.send_all_then_read_replies(_mutate(_frames(reqs), mutations))
    for r in replies:
        assert isinstance(r, dict) and "ok" in r and "id" in r
        if not r["ok"]:
            assert r["error"]["type"] != "InternalError", r
            assert r["error"]["message"]
    after = _daemon_contents(populated_daemon)
    assert after == before, "a mutated frame changed what the daemon stores"
    assert after[0] == {k: __import__("daemon_helpers").tensor_digest(t) for k, t in populated_daemon.specs.items()}


def test_fuzz_harness_smoke_without_atheris():
    """The atheris harness's oracle, fed seeded random and mutated inputs (atheris not needed)."""
    sys.path.insert(0, REPO)
    from tools import fuzz_protocol

    fuzz_protocol.run_random(iterations=300, seed=1)


def test_fuzz_harness_cli_without_atheris_is_a_clear_message(tmp_path):
    from fork_helpers import forked_python

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = forked_python([os.path.join(REPO, "tools", "fuzz_protocol.py"), "--random", "50"], stdout=True, env=env)
    try:
        out = proc.stdout.read()
        assert proc.wait(120) == 0, proc.stderr_text()[-2000:]
    finally:
        proc.close()
    assert "50 inputs" in out
    assert list(tmp_path.iterdir()) == [], "the harness left its temporary store behind"


def test_fuzz_harness_killed_by_sigterm_still_removes_its_store(tmp_path):
    from fork_helpers import forked_python

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = forked_python([os.path.join(REPO, "tools", "fuzz_protocol.py"), "--random", "10000000"], env=env)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.iterdir()) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert list(tmp_path.iterdir()), "the harness never created its store"
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM, proc.stderr_text()[-2000:]
    finally:
        proc.close()
    assert list(tmp_path.iterdir()) == [], "the harness left its temporary store behind"
