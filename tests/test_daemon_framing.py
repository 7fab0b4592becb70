"""Bad bytes on a live daemon's socket: a malformed frame gets an error reply and the connection
survives; a fatal framing error (a length prefix over ``daemon.max_frame_bytes``) closes only that
connection; random bytes never kill the daemon. The same rules sans I/O: test_daemon_protocol.py.
Helpers: tests/daemon_helpers.py.

Daemons:
- ``main``: 32 MiB host, NVMe, metrics on an ephemeral port, 64 KiB frame cap, lease 30 s.
"""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon_helpers import KiB, RawConn


# ========================================================================== malformed frames


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


MALFORMED = [
    ("garbage-body", _frame(b"\xc1\xc1\xc1"), None, "undecodable"),
    ("non-map", _frame(msgpack.packb([1, 2, 3])), None, "map"),
    ("bin-blob", _frame(msgpack.packb({"id": 3, "op": "ping", "x": b"\0" * 100}, use_bin_type=True)), None,
     "undecodable"),
    ("no-id", _frame(msgpack.packb({"op": "ping"})), None, "'id'"),
    ("unknown-op", _frame(msgpack.packb({"id": 5, "op": "explode"})), 5, "'op'"),
    ("wrong-type", _frame(msgpack.packb({"id": 6, "op": "get", "key": 7})), 6, "'key'"),
    ("bool-lease", _frame(msgpack.packb({"id": 7, "op": "release", "lease": True})), 7, "'lease'"),
    ("bad-shape", _frame(msgpack.packb({"id": 8, "op": "reserve", "key": "k", "dtype": "uint8", "shape": [-1]})),
     8, "'shape'"),
    ("extra-arg", _frame(msgpack.packb({"id": 9, "op": "stats", "verbose": 1})), 9, "'verbose'"),
]


@pytest.mark.parametrize("name, data, rid, words", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_frame_gets_an_error_reply_and_the_connection_survives(main_daemon, name, data, rid, words):
    with RawConn(main_daemon.socket_path) as raw:
        raw.send(data)
        r = raw.reply()
        assert r is not None, "the daemon hung up on a non-fatal error"
        assert r["ok"] is False and r["id"] == rid
        assert r["error"]["type"] == "ProtocolError"
        assert words in r["error"]["message"]
        assert raw.request({"id": 42, "op": "ping"}) == {"id": 42, "ok": True}


def test_invalid_key_is_a_typed_error_reply(main_daemon):
    with RawConn(main_daemon.socket_path) as raw:
        r = raw.request({"id": 1, "op": "get", "key": ""})
        assert r["ok"] is False and r["error"]["type"] == "InvalidKeyError"


@pytest.mark.parametrize("data", [
    b"\xff\xff\xff\xff",
    struct.pack(">I", 64 * KiB + 1) + b"\0" * 100,  # one byte over daemon.max_frame_bytes
    b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",  # 'GET ' read as a length prefix
], ids=["max-prefix", "cap+1", "http"])
def test_fatal_framing_error_closes_only_that_connection(main_daemon, client, data):
    with RawConn(main_daemon.socket_path) as bystander, RawConn(main_daemon.socket_path) as raw:
        raw.send(data)
        replies = raw.replies_until_eof()
        assert len(replies) == 1
        assert replies[0]["ok"] is False and replies[0]["error"]["type"] == "ProtocolError"
        assert "exceeds" in replies[0]["error"]["message"]
        assert bystander.request({"id": 1, "op": "ping"})["ok"]
    client.ping()


# ============================================================================== random bytes


_fuzz = st.one_of(
    st.binary(max_size=300),
    st.lists(st.one_of(st.binary(max_size=80).map(_frame),
                       st.binary(max_size=40),
                       st.dictionaries(st.sampled_from(["id", "op", "key", "lease", "shape", "dtype", "version"]),
                                       st.one_of(st.integers(-5, 1 << 40), st.text(max_size=8), st.booleans(),
                                                 st.lists(st.integers(-2, 9), max_size=3), st.none()),
                                       max_size=5).map(lambda m: _frame(msgpack.packb(m)))),
             max_size=5).map(b"".join),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_fuzz)
def test_random_bytes_never_kill_the_daemon(main_daemon, client, data):
    with RawConn(main_daemon.socket_path, timeout=10) as raw:
        replies = raw.send_all_then_read_replies(data)
    for r in replies:
        assert isinstance(r, dict) and "ok" in r and "id" in r
        if not r["ok"]:
            assert r["error"]["type"] in ("ProtocolError", "InvalidKeyError", "EntryTooLargeError",
                                          "InvalidTensorError", "EctierError"), r
    assert client.ping() < 1.0


def test_a_system_error_in_a_handler_is_an_error_reply_and_one_warning_without_traceback(monkeypatch, caplog):
    """An OSError on the request path (here EMFILE from the contains handler) answers the client
    with an error naming it, keeps the daemon serving, and logs one WARNING per op and errno
    (not a traceback per request: the same error repeats for every client until it is fixed)."""
    import errno
    import logging

    from daemon_helpers import daemon_config, remove_dir, serve_in_thread, short_tmpdir
    from ectier import CacheConfig
    from ectier.daemon import handlers
    from ectier.daemon.client import DaemonClient
    from ectier.errors import EctierError

    def out_of_descriptors(server, conn, **args):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setitem(handlers.HANDLERS, "contains", out_of_descriptors)
    d = short_tmpdir()
    server = thread = None
    try:
        cfg = CacheConfig.from_dict(daemon_config(d, nvme=False, host_bytes=1 << 20))
        server, thread = serve_in_thread(cfg)
        with caplog.at_level(logging.WARNING, logger="ectier.daemon"), \
                DaemonClient(cfg.daemon.socket_path) as c:
            for _ in range(5):
                with pytest.raises(EctierError, match="OSError.*Too many open files"):
                    c.contains("k")
            assert c.get("k") is None  # still serving
        lines = [r for r in caplog.records if "contains" in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno == logging.WARNING and lines[0].exc_info is None
    finally:
        if server is not None:
            server.stop()
            thread.join(10)
        remove_dir(d)


@pytest.mark.parametrize("cap", [8 << 20, 4 * KiB])
def test_the_client_keeps_to_the_daemons_frame_cap_and_says_which_knob(cap):
    """``hello`` announces ``daemon.max_frame_bytes``: a request up to it goes through (was capped
    at the built-in 1 MiB whatever the daemon allowed); a larger one is a ProtocolError, an
    EctierError naming the knob, and the connection stays usable."""
    import torch

    from daemon_helpers import daemon_config, make_tensor, remove_dir, serve_in_thread, short_tmpdir
    from ectier import CacheConfig
    from ectier.daemon.client import DaemonClient
    from ectier.daemon.protocol import ProtocolError
    from ectier.errors import EctierError

    d = short_tmpdir()
    server = thread = None
    try:
        cfg = CacheConfig.from_dict(daemon_config(d, nvme=False, host_bytes=1 << 20, max_frame_bytes=cap))
        server, thread = serve_in_thread(cfg)
        with DaemonClient(cfg.daemon.socket_path) as c:
            c.put("k", make_tensor(1, "uint8", (64,)))
            keys = [f"{i}" + "k" * 2000 for i in range(1024)]  # a ~2 MB prefetch request
            if cap > 4 << 20:
                assert len(c.prefetch(keys)) == 1024
            else:
                with pytest.raises(ProtocolError, match="daemon.max_frame_bytes") as exc:
                    c.put("x" * 8192, torch.ones(10))
                assert isinstance(exc.value, EctierError)
            assert c.get("k") is not None  # still connected, still served
            with pytest.raises(EctierError, match="shape"):  # the daemon's schema check: an EctierError too
                c.call("reserve", key="deep", dtype="float32", shape=[1] * 40)  # (put refuses it first)
            with pytest.raises(EctierError, match="40 dimensions"):
                c.put("deep", torch.ones([1] * 40))
    finally:
        if server is not None:
            server.stop()
            thread.join(10)
        remove_dir(d)
