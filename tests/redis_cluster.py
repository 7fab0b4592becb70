"""Real Redis servers for tests: a 3-node Redis Cluster and a single server on loopback.

Fixtures (import them into a test module: ``from redis_cluster import redis_cluster  # noqa: F401``):

- ``redis_cluster``: a 3-node cluster (no replicas) for the whole session;
- ``redis_cluster_fn``: a fresh 3-node cluster for one test (the test may kill or stop a node);
- ``redis_single``: one server without cluster mode, for the session (``redis_single_fn``: for one test);
- ``redis_single_auth``: one server started with ``--requirepass`` (:data:`AUTH_PASSWORD`);
- ``redis_single_tls``: one server that speaks TLS only (its CA in ``Servers.tls_ca_path``).

Each is a :class:`Servers`: ``addresses`` (``"127.0.0.1:P[,...]"``, as ``remote.addresses``
takes it), the node processes, and :meth:`Servers.raw` (a plain ``redis`` client to look behind
the backend's back).

What is needed is installed when missing: Debian's ``redis-server`` (``apt-get install``, as root),
the ``redis`` Python package comes with the ``test`` extra. If it truly cannot be had, the tests
that need it are skipped with the reason; on CI (``CI=true``) that is a failure instead.

The nodes run ``redis-server`` as subprocesses (``--daemonize no``, no persistence) in temporary
directories; the cluster is made by ``redis-cli --cluster create`` and used once every node reports
``cluster_state:ok``. ``cluster-require-full-coverage no``: when one node dies the others keep
serving their slots (as docs/operations.md recommends for a cluster without replicas).
Teardown kills every process and removes the directories.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from server_helpers import apt_install, ensure_installed, free_port, unavailable

AUTH_PASSWORD = "ectier-test-secret"
_STARTUP_S = 20.0


def _unavailable(reason: str) -> None:
    unavailable("Redis tests", reason)


def _install() -> str:
    """Install ``redis-server`` (and ``openssl`` for the TLS certificates); '' or why not."""
    missing = [p for p, tool in (("redis-server", "redis-server"), ("redis-tools", "redis-cli"),
                                 ("openssl", "openssl")) if shutil.which(tool) is None]
    if not missing:
        return ""
    why = apt_install(missing)
    if why:
        return f"{', '.join(missing)} missing: {why}"
    still = [t for t in ("redis-server", "redis-cli", "openssl") if shutil.which(t) is None]
    return f"{', '.join(still)} still missing after apt-get install" if still else ""


def ensure_tools() -> None:
    """Make ``redis-server``, ``redis-cli`` and the ``redis`` package available, or skip/fail."""
    ensure_installed("Redis tests", _install)
    try:
        import redis  # noqa: F401
    except ImportError as exc:
        _unavailable(f"the 'redis' Python package is missing (pip install -e '.[test]'): {exc}")


@dataclasses.dataclass
class Node:
    port: int
    directory: Path
    process: subprocess.Popen
    args: list[str]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclasses.dataclass
class Servers:
    """Running Redis servers: one node (single) or the nodes of a cluster."""

    nodes: list[Node]
    cluster: bool
    password: str | None = None
    tls_ca_path: str | None = None

    @property
    def addresses(self) -> str:
        return ",".join(n.address for n in self.nodes)

    def raw(self) -> Any:
        """A plain ``redis`` client (``RedisCluster`` or ``Redis``) on these servers."""
        import redis
        from redis.cluster import ClusterNode, RedisCluster
        kw: dict[str, Any] = dict(password=self.password, socket_timeout=10, socket_connect_timeout=10)
        if self.tls_ca_path:
            kw.update(ssl=True, ssl_ca_certs=self.tls_ca_path)
        if self.cluster:
            return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in self.nodes],
                                require_full_coverage=False, **kw)
        return redis.Redis("127.0.0.1", self.nodes[0].port, **kw)

    def node_of(self, key: str) -> Node:
        """The node that serves ``key``'s slot (cluster only)."""
        raw = self.raw()
        try:
            port = raw.get_node_from_key(key).port
        finally:
            raw.close()
        return next(n for n in self.nodes if n.port == port)

    def kill(self, node: Node) -> None:
        """SIGKILL one node (its port refuses connections from now on)."""
        node.process.kill()
        node.process.wait(timeout=10)

    def pause(self, node: Node) -> None:
        """SIGSTOP one node: it still accepts connections but answers nothing (a hung server)."""
        node.process.send_signal(signal.SIGSTOP)

    def resume(self, node: Node) -> None:
        node.process.send_signal(signal.SIGCONT)

    def restart(self, node: Node) -> None:
        """Start a killed node again on its port (a cluster node keeps its identity: nodes.conf)."""
        _stop(node)
        node.process = subprocess.Popen(node.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not _wait_ping(node, self.password, self.tls_ca_path):
            raise RuntimeError(f"redis-server on port {node.port} did not restart")

    def node_client(self, node: Node) -> Any:
        """A plain ``redis.Redis`` on one node."""
        import redis
        kw: dict[str, Any] = dict(ssl=True, ssl_ca_certs=self.tls_ca_path) if self.tls_ca_path else {}
        return redis.Redis("127.0.0.1", node.port, password=self.password, socket_timeout=10, **kw)

    def keys_on(self, node: Node, pattern: str = "*") -> set[str]:
        """Names of the keys that ``node`` holds (matching ``pattern``)."""
        c = self.node_client(node)
        try:
            return {k.decode() for k in c.scan_iter(match=pattern, count=1000)}
        finally:
            c.close()

    def all_keys(self, pattern: str = "*", *, live_only: bool = False) -> set[str]:
        """Names of the keys on every node (only the running ones with ``live_only``)."""
        out: set[str] = set()
        for n in self.nodes:
            if not live_only or n.process.poll() is None:
                out |= self.keys_on(n, pattern)
        return out


def _ping(port: int, password: str | None, tls_ca_path: str | None) -> bool:
    import redis
    kw: dict[str, Any] = dict(ssl=True, ssl_ca_certs=tls_ca_path) if tls_ca_path else {}
    client = redis.Redis("127.0.0.1", port, password=password, socket_timeout=1, socket_connect_timeout=1, **kw)
    try:
        return bool(client.ping())
    except Exception:
        return False
    finally:
        client.close()


def _wait_ping(node: Node, password: str | None, tls_ca_path: str | None) -> bool:
    end = time.monotonic() + _STARTUP_S
    while time.monotonic() < end and node.process.poll() is None:
        if _ping(node.port, password, tls_ca_path):
            return True
        time.sleep(0.05)
    return False


def _start_node(root: Path, cluster: bool, extra: list[str], password: str | None,
                tls: dict[str, str] | None) -> Node:
    """One ``redis-server`` on free ports, answering PING (ports are retried if taken meanwhile)."""
    last = ""
    for _ in range(3):
        port = free_port()
        d = root / f"node-{port}"
        d.mkdir()
        args = ["redis-server", "--bind", "127.0.0.1", "--dir", str(d), "--save", "", "--appendonly", "no",
                "--daemonize", "no", "--logfile", str(d / "redis.log")]
        if tls:
            args += ["--port", "0", "--tls-port", str(port), "--tls-cert-file", tls["cert"],
                     "--tls-key-file", tls["key"], "--tls-ca-cert-file", tls["ca"], "--tls-auth-clients", "no"]
        else:
            args += ["--port", str(port)]
        if cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(d / "nodes.conf"),
                     "--cluster-port", str(free_port()), "--cluster-require-full-coverage", "no",
                     "--cluster-node-timeout", "3000"]
        if password:
            args += ["--requirepass", password, "--masterauth", password]
        args += extra
        node = Node(port, d, subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), args)
        if _wait_ping(node, password, tls["ca"] if tls else None):
            return node
        proc = node.process
        _stop(node)
        log = (d / "redis.log").read_text(errors="replace")[-800:] if (d / "redis.log").exists() else ""
        last = f"redis-server on port {port} did not start (exit {proc.returncode}): {log}"
    raise RuntimeError(last)


def _stop(node: Node) -> None:
    if node.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            node.process.send_signal(signal.SIGCONT)
            node.process.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        node.process.wait(timeout=10)


def _create_cluster(nodes: list[Node], password: str | None) -> None:
    """``redis-cli --cluster create`` (3 masters, no replicas), then wait for cluster_state:ok."""
    import redis
    cmd = ["redis-cli", "--cluster", "create", *(n.address for n in nodes), "--cluster-replicas", "0",
           "--cluster-yes"]
    env = dict(os.environ, REDISCLI_AUTH=password) if password else None  # not on the command line
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"redis-cli --cluster create failed ({done.returncode}): {done.stdout[-800:]}"
                           f"{done.stderr[-800:]}")
    end = time.monotonic() + _STARTUP_S
    while time.monotonic() < end:
        states = []
        for n in nodes:
            c = redis.Redis("127.0.0.1", n.port, password=password, socket_timeout=2)
            try:
                info = c.cluster("INFO")
                states.append(info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0))
                              == len(nodes) and int(info.get("cluster_slots_ok", 0)) == 16384)
            finally:
                c.close()
        if all(states):
            return
        time.sleep(0.1)
    raise RuntimeError("the Redis cluster did not reach cluster_state:ok")


@contextlib.contextmanager
def running_servers(n_nodes: int = 3, *, cluster: bool = True, password: str | None = None,
                    tls: dict[str, str] | None = None, extra: list[str] | None = None) -> Iterator[Servers]:
    """Start Redis servers for the block (after :func:`ensure_tools`), then kill them and remove
    their directories. ``tls``: ``{"cert", "key", "ca"}`` paths to serve TLS only."""
    ensure_tools()
    root = Path(tempfile.mkdtemp(prefix="ectier-redis-"))
    nodes: list[Node] = []
    try:
        for _ in range(n_nodes if cluster else 1):
            nodes.append(_start_node(root, cluster, list(extra or []), password, tls))
        if cluster:
            _create_cluster(nodes, password)
        yield Servers(nodes, cluster, password, tls["ca"] if tls else None)
    finally:
        for node in nodes:
            _stop(node)
        shutil.rmtree(root, ignore_errors=True)


def make_tls_files(directory: Path) -> dict[str, str]:
    """A self-signed CA and a server certificate for 127.0.0.1 made with ``openssl`` (paths)."""
    ensure_tools()
    ca_key, ca, key, csr, cert = (str(directory / n) for n in ("ca.key", "ca.crt", "srv.key", "srv.csr", "srv.crt"))
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    for cmd in (
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "2",
         "-subj", "/CN=ectier test CA"],
        ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        ["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
         "-days", "2", "-extfile", str(ext)],
    ):
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    return {"cert": cert, "key": key, "ca": ca}


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Servers]:
    """A 3-node Redis Cluster on loopback for the session (do not kill its nodes)."""
    with running_servers(3) as servers:
        yield servers


@pytest.fixture
def redis_cluster_fn() -> Iterator[Servers]:
    """A fresh 3-node Redis Cluster for one test (which may kill or pause a node)."""
    with running_servers(3) as servers:
        yield servers


@pytest.fixture(scope="session")
def redis_single() -> Iterator[Servers]:
    """One Redis server without cluster mode, for the session."""
    with running_servers(cluster=False) as servers:
        yield servers


@pytest.fixture
def redis_single_fn() -> Iterator[Servers]:
    """One Redis server for one test (which may kill and restart it)."""
    with running_servers(cluster=False) as servers:
        yield servers


@pytest.fixture(scope="session")
def redis_single_auth() -> Iterator[Servers]:
    """One Redis server that requires :data:`AUTH_PASSWORD` (``--requirepass``)."""
    with running_servers(cluster=False, password=AUTH_PASSWORD) as servers:
        yield servers


@pytest.fixture(scope="session")
def redis_single_tls() -> Iterator[Servers]:
    """One Redis server that speaks TLS only (certificate of a throw-away CA: ``tls_ca_path``)."""
    ensure_tools()
    d = Path(tempfile.mkdtemp(prefix="ectier-redis-tls-"))
    try:
        with running_servers(cluster=False, tls=make_tls_files(d)) as servers:
            yield servers
    finally:
        shutil.rmtree(d, ignore_errors=True)
