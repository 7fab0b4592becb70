"""The standalone cache daemon, end to end: real daemon processes, real client processes.

Daemons are started as subprocesses (``ectier serve`` / ``python -m ectier.daemon``) on sockets in
short temporary directories under /tmp, with their host arena and NVMe store in the same
directory; client processes use a ``spawn`` multiprocessing context and receive seeds, never
tensors. Every daemon is stopped in a ``finally`` (SIGTERM, then SIGKILL). Shared helpers and the
daemons below: tests/daemon_helpers.py.

Here: puts and gets through a daemon, the two-phase reserve/commit, typed errors, several
processes at once, ``ectier stats`` and the metrics endpoint. Elsewhere: leases
(test_daemon_leases.py), start/stop/restart/crash (test_daemon_lifecycle.py), who may connect
(test_daemon_security.py), bad bytes on the socket (test_daemon_framing.py), connection limits
(test_daemon_connection_caps.py) and idle timeouts (test_daemon_connections.py), the protocol
sans I/O (test_daemon_protocol.py).

Daemons:
- ``main``: 32 MiB host, NVMe, metrics on an ephemeral port, 64 KiB frame cap, lease 30 s.
"""

from __future__ import annotations

import contextlib

import json
import os
import urllib.request
import zlib

import pytest
import torch
from click.testing import CliRunner

from daemon_helpers import (
    KiB,
    MiB,
    SPAWN,
    assert_same,
    consumer,
    make_tensor,
    producer,
    remove_dir,
    short_tmpdir,
    spec_digest,
    write_arena,
)
from ectier import testing_daemon
from ectier.cli import main as cli_main
from ectier.daemon.client import DaemonClient
from ectier.daemon.protocol import PROTOCOL_VERSION, ProtocolError
from ectier.errors import EctierError, EntryTooLargeError, InvalidKeyError


# =========================================================================== basic behaviour


CASES = [
    ("bf16-1", torch.bfloat16, (1, 8192)),
    ("bf16-7", torch.bfloat16, (7, 8192)),
    ("bf16-64", torch.bfloat16, (64, 8192)),  # 1 MiB, exactly 16 blocks
    ("fp32", torch.float32, (129, 33)),
    ("int8", torch.int8, (1000, 1000)),
    ("uint8-odd", torch.uint8, (65537,)),  # one byte into a second block
    ("fp16", torch.float16, (3, 5, 7)),
    ("bool", torch.bool, (4097,)),
    ("int64-scalar", torch.int64, ()),
    ("bf16-empty", torch.bfloat16, (0, 8192)),
    ("fp32-empty", torch.float32, (5, 0)),
]


@pytest.mark.parametrize("name, dtype, shape", CASES, ids=[c[0] for c in CASES])
def test_put_get_byte_exact(client, name, dtype, shape):
    t = make_tensor(zlib.crc32(name.encode()), str(dtype).removeprefix("torch."), shape)
    key = f"rt-{name}"
    client.put(key, t)
    assert client.contains(key)
    assert_same(client.get(key), t)
    assert_same(client.get(key), t)  # a second read sees the same bytes


def test_non_contiguous_tensor_is_stored_in_c_order(client):
    t = make_tensor(11, "float32", (64, 48)).t()  # transposed view
    assert not t.is_contiguous()
    client.put("rt-transposed", t)
    assert_same(client.get("rt-transposed"), t)


def test_overwrite_with_another_shape_and_dtype(client):
    a = make_tensor(1, "bfloat16", (16, 8192))
    b = make_tensor(2, "float32", (3, 5))
    client.put("ow", a)
    before = client.stats()
    client.put("ow", b)
    assert_same(client.get("ow"), b)
    after = client.stats()
    assert after["entries"] == before["entries"]  # replaced, not added
    assert after["tiers"]["host"]["used_bytes"] == before["tiers"]["host"]["used_bytes"] - 3 * 64 * KiB  # 4 blocks -> 1
    client.put("ow", a)
    assert_same(client.get("ow"), a)


def test_namespaces_are_separate(client):
    a = make_tensor(21, "bfloat16", (2, 8192))
    b = make_tensor(22, "bfloat16", (2, 8192))
    client.put("shared-key", a, namespace="model-a")
    client.put("shared-key", b, namespace="model-b")
    assert_same(client.get("shared-key", namespace="model-a"), a)
    assert_same(client.get("shared-key", namespace="model-b"), b)
    assert not client.contains("shared-key")  # the daemon's namespace is "test"
    assert client.get("shared-key") is None
    assert client.delete("shared-key", namespace="model-a")
    assert not client.contains("shared-key", namespace="model-a")
    assert_same(client.get("shared-key", namespace="model-b"), b)


def test_delete_and_misses(client):
    t = make_tensor(31, "int8", (100,))
    client.put("del-me", t)
    misses = client.stats()["misses"]
    assert client.delete("del-me") is True
    assert client.delete("del-me") is False
    assert not client.contains("del-me")
    assert client.get("del-me") is None
    assert client.get("never-put") is None
    assert client.stats()["misses"] == misses + 2


def test_reserved_entry_is_invisible_until_commit(main_daemon, client):
    other = DaemonClient(main_daemon.socket_path, client_name="observer")
    try:
        payload = bytes(range(256)) * 1024  # 256 KiB
        r = client.call("reserve", key="two-phase", dtype="uint8", shape=[len(payload)])
        assert r["nbytes"] == len(payload)
        assert sum(length for _, length in r["extents"]) == len(payload)
        assert not other.contains("two-phase")
        assert other.get("two-phase") is None
        write_arena(client.server_info["arena"]["path"], r["extents"], payload)
        assert not other.contains("two-phase")
        assert client.call("commit", lease=r["lease"]) == {}
        got = other.get("two-phase")
        assert got is not None and got.numpy().tobytes() == payload
        # a second commit of the same lease is refused
        with pytest.raises(EctierError, match="unknown or expired"):
            client.call("commit", lease=r["lease"])
    finally:
        other.close()


def test_abort_returns_the_bytes(main_daemon, client):
    used = client.stats()["tiers"]["host"]["used_bytes"]
    r = client.call("reserve", key="aborted", dtype="uint8", shape=[3 * 64 * KiB])
    assert client.stats()["tiers"]["host"]["used_bytes"] >= used  # reserved bytes may count as used
    assert client.call("abort", lease=r["lease"]) == {"aborted": True}
    assert client.call("abort", lease=r["lease"]) == {"aborted": False}
    assert client.stats()["tiers"]["host"]["used_bytes"] == used
    assert not client.contains("aborted")


def test_typed_errors_map_back_to_ectier_errors(client):
    with pytest.raises(EntryTooLargeError, match="host.capacity_bytes"):
        client.call("reserve", key="too-big", dtype="uint8", shape=[64 * MiB])
    with pytest.raises(InvalidKeyError):
        client.contains("")
    with pytest.raises(InvalidKeyError):
        client.put("", make_tensor(1, "uint8", (4,)))
    with pytest.raises(ProtocolError, match="'dtype'"):
        client.call("reserve", key="k", dtype="float128", shape=[1])
    with pytest.raises(ProtocolError, match="'op'"):
        client.call("explode")
    with pytest.raises(EntryTooLargeError):  # 2**1500 bytes: refused, not an internal error
        client.call("reserve", key="k", dtype="float64", shape=[(1 << 48) - 1] * 32)
    with pytest.raises(InvalidKeyError):  # a lone surrogate cannot be sent; the cache refuses it too
        client.contains("\ud800")
    assert client.ping() < 1.0  # the connection is still fine


def test_a_too_large_non_contiguous_put_is_refused_before_any_copy(client):
    """``put`` of an expanded (stride-0) tensor of 4 TiB logical bytes: the daemon's refusal
    (``EntryTooLargeError``) comes first, as in-process; the client copied it into one contiguous
    tensor before asking, which failed with an untyped allocation error (or copied gigabytes for
    an entry that was then refused)."""
    with pytest.raises(EntryTooLargeError):
        client.put("huge-view", torch.zeros(1).expand(1 << 40))
    assert not client.contains("huge-view") and client.ping() < 1.0


def test_hello_with_a_wrong_version_is_a_protocol_error(main_daemon, client):
    with pytest.raises(ProtocolError, match="protocol"):
        client.call("hello", version=PROTOCOL_VERSION + 1)
    client.ping()
    c = DaemonClient(main_daemon.socket_path)
    try:
        import ectier.daemon.client_conn as client_mod

        orig = client_mod.PROTOCOL_VERSION
        client_mod.PROTOCOL_VERSION = PROTOCOL_VERSION + 41
        try:
            with pytest.raises(ProtocolError, match="protocol"):
                c.connect()
        finally:
            client_mod.PROTOCOL_VERSION = orig
        c.connect()
    finally:
        c.close()


def test_stats_report_clients_and_leases(main_daemon, client):
    client.put("stat-me", make_tensor(51, "uint8", (10,)))
    g = client.call("get", key="stat-me")
    try:
        s = client.stats()
        d = s["daemon"]
        assert d["socket"] == main_daemon.socket_path
        assert d["leases"]["get"] >= 1
        me = [c for c in d["clients"] if c["name"] == "pytest-main"]
        assert len(me) == 1 and me[0]["pid"] == os.getpid() and me[0]["leases"] == 1
        assert set(s["tiers"]) == {"host", "nvme"}
    finally:
        assert client.call("release", lease=g["lease"])["valid"]
    assert client.stats()["daemon"]["leases"]["get"] == 0


# ========================================================================= several processes


PC_SPECS = [
    ("pc-bf16-4", 101, "bfloat16", (4, 8192)),  # 64 KiB
    ("pc-bf16-37", 102, "bfloat16", (37, 8192)),
    ("pc-bf16-256", 103, "bfloat16", (256, 8192)),  # 4 MiB
    ("pc-fp32", 104, "float32", (129, 33)),
    ("pc-int8", 105, "int8", (1000, 1000)),
    ("pc-empty", 106, "bfloat16", (0, 8192)),
]


HOT = [("pc-hot", 111, "bfloat16", (64, 8192)), ("pc-hot", 112, "bfloat16", (64, 8192))]  # 1 MiB each


def test_producer_and_two_concurrent_consumers(main_daemon):
    """A producer puts entries, then keeps overwriting one hot key with two versions while two
    consumers read everything concurrently: every read is byte-exact, a hot read is one whole
    version (never a mix), nothing misses."""
    expected = {spec[0]: spec_digest(spec) for spec in PC_SPECS}
    hot_versions = {spec_digest(s) for s in HOT}
    keys = list(expected) + ["pc-hot"]
    done, stop = SPAWN.Event(), SPAWN.Event()
    barrier = SPAWN.Barrier(2)
    results = SPAWN.Queue()
    procs = [SPAWN.Process(target=producer, args=(main_daemon.socket_path, PC_SPECS, done, HOT, stop))]
    procs += [SPAWN.Process(target=consumer, args=(main_daemon.socket_path, keys, 4, done, barrier, results))
              for _ in range(2)]
    try:
        for p in procs:
            p.start()
        got = [results.get(timeout=60) for _ in range(2)]
        stop.set()
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        stop.set()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    for status, seen in got:
        assert status == "ok", seen
        hot = seen.pop("pc-hot")
        assert seen == {k: [v] for k, v in expected.items()}  # every read, byte-exact, no miss
        assert hot and set(hot) <= hot_versions, hot  # whole versions only


# =========================================================================== CLI and metrics


def test_stats_command_prints_tiers_and_clients(main_daemon, client):
    client.put("cli-visible", make_tensor(91, "uint8", (10,)))
    runner = CliRunner(env={"COLUMNS": "200"})
    r = runner.invoke(cli_main, ["stats", "--socket", main_daemon.socket_path])
    assert r.exit_code == 0, r.output
    for words in ("tiers", "host", "nvme", "used / capacity", "clients", "pytest-main", "ectier-stats",
                  main_daemon.socket_path, "view pins: 0 lease(s)", "per process", "in all"):
        assert words in r.output, words
    r = runner.invoke(cli_main, ["stats", "--socket", main_daemon.socket_path, "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["tiers"]["host"]["capacity_bytes"] == 32 * MiB
    assert data["entries"] >= 1
    assert any(c["name"] == "ectier-stats" for c in data["daemon"]["clients"])


def test_stats_command_without_a_daemon_is_a_clean_error():
    d = short_tmpdir()
    try:
        r = CliRunner().invoke(cli_main, ["stats", "--socket", os.path.join(d, "nobody.sock")])
        assert r.exit_code != 0
        assert isinstance(r.exception, SystemExit)
        assert "Traceback" not in r.output
        assert "cannot reach" in r.output and "nobody.sock" in r.output
    finally:
        remove_dir(d)


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _listening_addresses(port: int) -> list[str]:
    """Local addresses of TCP sockets listening on ``port`` (from /proc/net/tcp{,6})."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, p = fields[1].split(":")
            if int(p, 16) == port and fields[3] == "0A":
                found.append(addr)
    return found


def test_metrics_endpoint(main_daemon, client):
    t = make_tensor(95, "bfloat16", (4, 8192))
    client.put("metric-me", t)
    client.get("metric-me")
    assert client.prefetch(["metric-me"]) == ["ready"]  # in the arena: pinned for a get
    s = client.stats()
    metrics = s["daemon"].get("metrics")
    assert metrics is not None, "stats must say where the metrics endpoint listens (metrics_port: 0)"
    port = metrics["port"]
    assert metrics["host"] == "127.0.0.1" and port > 0
    m = _metrics(port)
    host = s["tiers"]["host"]
    assert m['ectier_tier_used_bytes{tier="host"}'] == host["used_bytes"]
    assert m['ectier_tier_capacity_bytes{tier="host"}'] == 32 * MiB
    assert m['ectier_tier_entries{tier="host"}'] == host["entries"]
    assert 'ectier_tier_used_bytes{tier="nvme"}' in m
    assert m['ectier_lookups_total{result="hit"}'] >= 1
    assert m["ectier_clients"] >= 1
    assert m['ectier_leases{kind="get"}'] == 0
    assert "ectier_leases_expired_total" in m
    for reason in ("idle", "evicted"):
        assert m[f'ectier_connections_closed_total{{reason="{reason}"}}'] == s["daemon"][
            "idle_closed" if reason == "idle" else "evicted"]
    assert m["ectier_connections_refused_total"] >= s["daemon"]["refused"]
    assert m["ectier_prefetch_held_bytes"] == s["daemon"]["prefetch"]["held_bytes"] == 4 * 8192 * 2
    assert m['ectier_prefetches_total{result="taken"}'] == s["daemon"]["prefetch"]["taken"]
    client.get("metric-me")  # takes the pin over and releases it
    assert _metrics(port)["ectier_prefetch_held_bytes"] == 0
    assert _listening_addresses(port) == ["0100007F"]  # 127.0.0.1 only


def test_client_registers_its_arena_mapping_with_cuda_when_present(tmp_path, monkeypatch):
    """On a GPU machine the client page-locks its mapping of the arena (cudaHostRegister) and
    unregisters it when it unmaps; emulated here with a fake cudart, since CI has no GPU."""
    import torch

    from ectier.daemon.client import DaemonClient

    calls = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    devices = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    monkeypatch.setattr(torch.cuda, "device", lambda d: devices.append(d) or contextlib.nullcontext())
    arena = tmp_path / "arena"
    arena.write_bytes(b"\0" * 65536)
    client = DaemonClient(str(tmp_path / "no.sock"))
    client.server_info = {"arena": {"path": str(arena), "nbytes": 65536, "block_bytes": 4096}}
    view = testing_daemon.map_arena(client)
    assert calls == []  # registered at the first put of a CUDA tensor, under that tensor's device
    assert testing_daemon.page_lock_arena(client, torch.device("cuda", 1))
    assert calls == [("register", view.data_ptr(), 65536, 1)] and devices == [torch.device("cuda", 1)]  # portable
    assert testing_daemon.page_lock_arena(client, torch.device("cuda", 1)) and len(calls) == 1  # once
    ptr = view.data_ptr()
    del view
    client.close()
    assert calls[-1] == ("unregister", ptr)


def test_a_closed_client_stays_closed(main_daemon):
    """After close(), calls raise DaemonUnavailableError naming close() (they reconnected silently:
    a TieredCache raises after close too); a new client works."""
    from ectier.daemon.client import DaemonUnavailableError

    c = DaemonClient(main_daemon.socket_path)
    c.put("closed-k", make_tensor(1, "uint8", (10,)))
    c.close()
    for call in (lambda: c.get("closed-k"), lambda: c.contains("closed-k"), c.connect):
        with pytest.raises(DaemonUnavailableError, match="closed"):
            call()
    assert c.connect_in_background() is False
    with DaemonClient(main_daemon.socket_path) as fresh:
        assert fresh.contains("closed-k")


@pytest.mark.parametrize("kind", ["file", "directory", "too long"])
def test_a_socket_path_that_can_never_work_fails_at_once(tmp_path, kind):
    """A path that is no socket (a file, a directory) or is too long for AF_UNIX cannot come
    right by waiting: the first call fails at once, naming why, instead of retrying for
    ``connect_retry_s`` (5 s by default) as for a daemon not up yet."""
    import time

    from ectier.daemon.client import DaemonUnavailableError

    path = tmp_path / "ectier.sock"
    if kind == "file":
        path.write_text("")
    elif kind == "directory":
        path.mkdir()
    else:
        path = tmp_path / ("x" * 120) / "ectier.sock"
    c = DaemonClient(str(path), connect_retry_s=5.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailableError, match="not a socket" if kind != "too long" else "too long"):
            c.contains("k")
        assert time.monotonic() - t0 < 1.0
    finally:
        c.close()
