"""Two hosts on one machine for tests: two network namespaces joined by a veth pair, and a Redis
Cluster reachable across the pair.

:func:`two_hosts` creates namespaces ``ect<pid>a`` and ``ect<pid>b`` (``ip netns add``, as root),
a veth pair with one end in each (``10.213.0.1/30`` in ``a``, ``10.213.0.2/30`` in ``b``; loopback
up in both) and yields a :class:`Hosts`; on exit it kills every process started in them and
deletes both namespaces (which removes the pair), also when the block raised. Namespaces a killed
earlier run left behind (its pid gone) are deleted first.

:func:`redis_cluster_in` starts a 3-node Redis Cluster inside one namespace, bound to that
namespace's veth address only (``--bind 10.213.0.1``): the other namespace reaches it across the
pair (:meth:`Hosts.rx_bytes` counts what crossed it).

:func:`unavailable_reason` says why namespaces cannot be made here (not root; no ``ip`` even after
``apt-get install iproute2``); the test skips with it, and on CI (``CI=true``) fails instead (as
``tests/redis_cluster.py`` does).

Run as a script (``python tests/netns.py put|get CONFIG.json KEYS.json``) it is the producer or
consumer process of a test, started in a namespace with ``ip netns exec``: ``put`` stores every
``[key, seed, rows]`` of ``KEYS.json`` in a ``TieredCache`` built from ``CONFIG.json`` and waits for
the remote write-throughs; ``get`` reads them; both print one JSON line
``{"digests": {key: digest or null}, "remote": stats()["tiers"]["remote"]}``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from server_helpers import apt_install

SUBNET = "10.213.0"
PREFIX = "ect"
_STARTUP_S = 30.0


def _install_ip() -> str:
    """Install Debian's ``iproute2`` (the ``ip`` command) with apt-get; '' or why not."""
    why = apt_install(["iproute2"])
    if why:
        return f"the ip command is missing: {why}"
    return "" if shutil.which("ip") else "the ip command is still missing after apt-get install iproute2"


def unavailable_reason() -> str:
    """'' if network namespaces can be made here (installing ``iproute2`` when missing), else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        why = _install_ip()
        if why:
            return why
    probe = f"{PREFIX}{os.getpid()}probe"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"ip netns add failed: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


@dataclasses.dataclass
class Host:
    """One namespace: its ``name``, its end of the veth pair (``dev``) and its ``address`` there."""

    name: str
    address: str
    dev: str

    def cmd(self, *args: str) -> list[str]:
        """``args`` run inside this namespace."""
        return ["ip", "netns", "exec", self.name, *args]


@dataclasses.dataclass
class Hosts:
    a: Host
    b: Host
    processes: list[subprocess.Popen] = dataclasses.field(default_factory=list)

    def popen(self, host: Host, args: list[str], **kw) -> subprocess.Popen:
        """Start ``args`` in ``host``'s namespace; killed when the namespaces go."""
        p = subprocess.Popen(host.cmd(*args), **kw)
        self.processes.append(p)
        return p

    def run(self, host: Host, args: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        """Run ``args`` in ``host``'s namespace to completion (output captured, text)."""
        return subprocess.run(host.cmd(*args), capture_output=True, text=True, timeout=timeout, **kw)

    def rx_bytes(self, host: Host) -> int:
        """Bytes ``host`` received on its end of the veth pair so far."""
        done = self.run(host, ["cat", f"/sys/class/net/{host.dev}/statistics/rx_bytes"], timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"cannot read the veth counters in {host.name}: {done.stderr.strip()}")
        return int(done.stdout)


def _leftovers() -> list[str]:
    """Namespaces of earlier runs whose process is gone."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    stale = []
    for name in re.findall(rf"^({PREFIX}(\d+)[ab])\b", out, flags=re.M):
        try:
            os.kill(int(name[1]), 0)
        except ProcessLookupError:
            stale.append(name[0])
        except PermissionError:
            pass
    return stale


@contextlib.contextmanager
def two_hosts() -> Iterator[Hosts]:
    """Two namespaces joined by a veth pair (see the module docstring); removed after."""
    for name in _leftovers():
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    pid = os.getpid()
    hosts = Hosts(Host(f"{PREFIX}{pid}a", f"{SUBNET}.1", f"ev{pid}a"),
                  Host(f"{PREFIX}{pid}b", f"{SUBNET}.2", f"ev{pid}b"))
    made: list[str] = []
    try:
        for h in (hosts.a, hosts.b):
            _ip("netns", "add", h.name)
            made.append(h.name)
        _ip("link", "add", hosts.a.dev, "netns", hosts.a.name, "type", "veth", "peer", "name", hosts.b.dev,
            "netns", hosts.b.name)
        for h in (hosts.a, hosts.b):
            _ip("addr", "add", f"{h.address}/30", "dev", h.dev, ns=h.name)
            _ip("link", "set", h.dev, "up", ns=h.name)
            _ip("link", "set", "lo", "up", ns=h.name)
        yield hosts
    finally:
        for p in hosts.processes:
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def namespace_exists(name: str) -> bool:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return re.search(rf"^{re.escape(name)}\b", out, flags=re.M) is not None


# ----------------------------------------------------------------------------- Redis in a namespace


def _redis_cli(hosts: Hosts, host: Host, port: int, *args: str, timeout: float = 10) -> str:
    done = hosts.run(host, ["redis-cli", "-h", host.address, "-p", str(port), *args], timeout=timeout)
    return done.stdout if done.returncode == 0 else ""


@contextlib.contextmanager
def redis_cluster_in(hosts: Hosts, host: Host, ports: tuple[int, ...] = (7101, 7102, 7103)) -> Iterator[str]:
    """A 3-node Redis Cluster (no replicas) in ``host``'s namespace, bound to ``host.address``
    only; yields its addresses (``"ip:port,..."``, as ``remote.addresses`` takes them)."""
    root = Path(tempfile.mkdtemp(prefix="ectier-netns-redis-"))
    procs = []
    try:
        for port in ports:
            d = root / str(port)
            d.mkdir()
            args = ["redis-server", "--bind", host.address, "--port", str(port), "--dir", str(d), "--save", "",
                    "--appendonly", "no", "--daemonize", "no", "--logfile", str(d / "redis.log"),
                    "--protected-mode", "no", "--cluster-enabled", "yes", "--cluster-config-file",
                    str(d / "nodes.conf"), "--cluster-require-full-coverage", "no", "--cluster-node-timeout", "3000"]
            procs.append(hosts.popen(host, args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        end = time.monotonic() + _STARTUP_S
        for port in ports:
            while "PONG" not in _redis_cli(hosts, host, port, "ping"):
                if time.monotonic() > end or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"redis-server on {host.address}:{port} in {host.name} did not start")
                time.sleep(0.1)
        addresses = [f"{host.address}:{p}" for p in ports]
        done = hosts.run(host, ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0",
                                "--cluster-yes"], timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-800:]}{done.stderr[-800:]}")
        while not all("cluster_state:ok" in _redis_cli(hosts, host, p, "cluster", "info") for p in ports):
            if time.monotonic() > end:
                raise RuntimeError("the Redis cluster in the namespace did not reach cluster_state:ok")
            time.sleep(0.1)
        yield ",".join(addresses)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------ the producer / consumer process


def _main(argv: list[str]) -> int:
    import hashlib

    import torch

    from ectier import CacheConfig, TieredCache, testing

    role, cfg_path, keys_path = argv
    cfg = CacheConfig.from_dict(json.loads(Path(cfg_path).read_text()))
    specs = json.loads(Path(keys_path).read_text())
    out: dict[str, str | None] = {}
    with TieredCache(cfg) as cache:
        for key, seed, rows in specs:
            if role == "put":
                t = torch.randn(rows, 2048, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
                cache.put(key, t)
            else:
                t = cache.get(key)
            out[key] = None if t is None else hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()
        if role == "put" and not testing.drain(cache, timeout_s=60):
            print("write-throughs did not drain in 60 s", file=sys.stderr)
            return 1
        print(json.dumps({"digests": out, "remote": cache.stats()["tiers"]["remote"]}))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
