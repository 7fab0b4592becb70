"""``DaemonClient``'s own arguments are checked when it is made, each error naming the argument
(a newcomer run found ``DaemonClient(123)`` a raw ``TypeError`` from ``socket``, ``connect_retry_s=-1``
accepted, ``client_name=5`` refused only by the daemon as a ``ProtocolError``); a client that gives
no name is shown as ``(unnamed)``, not as an empty string."""

from __future__ import annotations

import pytest

from daemon_helpers import MiB, daemon_config, daemon_stats, remove_dir, serve_in_thread, short_tmpdir
from daemon_helpers import RawConn
from ectier import CacheConfig
from ectier.daemon.client import DaemonClient


@pytest.mark.parametrize("kwargs, error, names", [
    ({"socket_path": 123}, TypeError, "socket_path"),
    ({"client_name": 5}, TypeError, "client_name"),
    ({"connect_retry_s": -1}, ValueError, "connect_retry_s"),
    ({"backoff_s": float("inf")}, ValueError, "backoff_s"),
    ({"timeout_s": 0}, ValueError, "timeout_s"),
    ({"probe_timeout_s": True}, ValueError, "probe_timeout_s"),
])
def test_bad_arguments_are_refused_at_once_naming_them(kwargs, error, names):
    with pytest.raises(error, match=names):
        DaemonClient(**kwargs)


def test_zero_waits_and_a_path_object_are_fine(tmp_path):
    c = DaemonClient(tmp_path / "d.sock", connect_retry_s=0, backoff_s=0)
    assert c.socket_path == str(tmp_path / "d.sock")
    c.close()


def test_a_client_without_a_name_is_shown_as_unnamed():
    d = short_tmpdir()
    server, t = serve_in_thread(CacheConfig.from_dict(daemon_config(d, nvme=False, host_bytes=4 * MiB)))
    try:
        with RawConn(server.socket_path) as raw:
            assert raw.request({"id": 1, "op": "hello", "version": 1})["ok"]
            names = [c["name"] for c in daemon_stats(server.socket_path)["daemon"]["clients"]]
            assert "(unnamed)" in names, names
    finally:
        server.stop()
        t.join(10)
        remove_dir(d)
