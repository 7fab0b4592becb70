"""Two hosts: an encoder node and a prefill/decode node in two network namespaces joined by a veth
pair (``tests/netns.py``), the store in the encoder's namespace bound to its veth address only
(per backend: a Redis Cluster; a Mooncake master and store node). The producer (a ``TieredCache`` process in namespace ``a``) puts; the consumer (an ``ectier
serve`` daemon in namespace ``b``, with its own store directory) serves the entries byte-exact
through the remote tier, across the pair, and again after it restarted.

Needs root (``ip netns``): skipped with the reason otherwise, a failure on CI (``CI=true``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
from typing import Iterator

import pytest
import torch

import netns
from daemon_helpers import (ECTIER_SCRIPT, PYTHON, DaemonProcess, clean_env, daemon_config, daemon_stats, remove_dir,
                            short_tmpdir, write_config)
from redis_cluster import ensure_tools

from ectier.daemon.client import DaemonClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def hosts():
    reason = netns.unavailable_reason()
    if reason:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"the two-host test must run on CI: {reason}")
        pytest.skip(reason)
    ensure_tools()  # redis-server, redis-cli
    with netns.two_hosts() as h:
        yield h
    assert not netns.namespace_exists(h.a.name) and not netns.namespace_exists(h.b.name)


@contextlib.contextmanager
def _redis_in(hosts: netns.Hosts, host: netns.Host) -> Iterator[dict]:
    with netns.redis_cluster_in(hosts, host) as addresses:
        yield {"backend": "redis", "addresses": addresses, "timeout_s": 2.0, "backoff_s": 0.5}


@contextlib.contextmanager
def _mooncake_in(hosts: netns.Hosts, host: netns.Host) -> Iterator[dict]:
    from mooncake_master import running_store  # the master and one store node, in ``host``'s namespace

    with running_store(address=host.address, run_in=host.cmd) as store:
        yield store.remote_dict(timeout_s=2.0, backoff_s=0.5)


#: backend -> ``(hosts, host) ->`` a context manager running its servers in ``host``'s namespace,
#: yielding the ``remote:`` section that reaches them
STORES_IN_NAMESPACE = {"redis": _redis_in, "mooncake": _mooncake_in}


@pytest.fixture(params=sorted(STORES_IN_NAMESPACE))
def remote_in_a(hosts, request):
    """The ``remote:`` section of a store running in namespace ``a`` (the encoder's host)."""
    with STORES_IN_NAMESPACE[request.param](hosts, hosts.a) as remote:
        yield remote


class NamespacedDaemon(DaemonProcess):
    """``ectier serve --config`` run inside a namespace (its Unix socket is reachable from here:
    a path socket does not belong to a network namespace)."""

    def __init__(self, host: netns.Host, config_path: str, socket_path: str) -> None:
        super().__init__(config_path, socket_path, via="script")
        self.host = host

    def launch(self) -> "NamespacedDaemon":
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.host.cmd(ECTIER_SCRIPT, "serve", "--config", self.config_path),
                                     stdout=self._log, stderr=subprocess.STDOUT, env=clean_env(),
                                     stdin=subprocess.DEVNULL)
        return self


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()


def _run_producer(hosts, d: str, remote: dict, specs: list) -> dict:
    cfg = {"namespace": "qwen3-vl", "host": {"capacity_bytes": "32MiB", "pin_memory": False},
           "nvme": {"path": os.path.join(d, "nvme"), "capacity_bytes": "64MiB", "sync": False}, "remote": remote}
    cfg_path, keys_path = os.path.join(d, "producer.json"), os.path.join(d, "keys.json")
    write_config(cfg_path, cfg)
    write_config(keys_path, specs)
    env = dict(clean_env(), PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    done = hosts.run(hosts.a, [PYTHON, os.path.join(ROOT, "tests", "netns.py"), "put", cfg_path, keys_path],
                     timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_entry_put_on_one_host_is_served_on_the_other_across_a_restart(hosts, remote_in_a):
    remote = remote_in_a
    specs = [[f"img{i}", i, 1024] for i in range(4)]  # 4 MiB each: chunks on every node
    d = short_tmpdir()
    os.chmod(d, 0o755)
    try:
        produced = _run_producer(hosts, d, remote, specs)
        assert produced["remote"]["puts"] == 4 and all(produced["digests"].values())
        cfg = daemon_config(os.path.join(d, "pd"), host_bytes=32 * 2**20, nvme_bytes=64 * 2**20,
                            namespace="qwen3-vl")
        os.makedirs(os.path.join(d, "pd"))
        cfg["remote"] = remote
        consumer = NamespacedDaemon(hosts.b, write_config(os.path.join(d, "pd", "cfg.yaml"), cfg),
                                    cfg["daemon"]["socket_path"])
        try:
            consumer.start(timeout=60)
            rx = hosts.rx_bytes(hosts.b)
            with DaemonClient(consumer.socket_path, client_name="pd") as c:
                for key in ("img0", "img1"):
                    got = c.get(key)
                    assert got is not None and _digest(got) == produced["digests"][key], key
            st = daemon_stats(consumer.socket_path)["tiers"]["remote"]
            assert st["hits"] == 2 and st["addresses"] == remote["addresses"]
            assert hosts.rx_bytes(hosts.b) - rx >= 2 * 4 * 2**20  # the bytes came across the pair

            consumer.terminate()
            consumer.start(timeout=60)
            with DaemonClient(consumer.socket_path, client_name="pd") as c:
                for key, digest in produced["digests"].items():
                    got = c.get(key)
                    assert got is not None and _digest(got) == digest, key
            st = daemon_stats(consumer.socket_path)["tiers"]["remote"]
            assert st["hits"] == 2  # img2, img3 across the pair; img0, img1 from its own NVMe
            assert st["errors"] + st["timeouts"] + st["checksum_failures"] == 0
        finally:
            consumer.stop()
    finally:
        remove_dir(d)
