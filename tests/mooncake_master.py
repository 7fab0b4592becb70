"""A real Mooncake Store for tests: ``mooncake_master`` (with its HTTP metadata server) and one
store node (``mooncake_client``, lending its memory to the store), on loopback ports picked here.

Fixtures (import them into a test module: ``from mooncake_master import mooncake_store  # noqa: F401``):

- ``mooncake_store``: master and store node for the whole session (do not kill them);
- ``mooncake_store_fn``: a fresh pair for one test (the test may kill, pause or restart the master).

Each is a :class:`Store`: ``master_address`` (as ``remote.addresses`` takes it),
``metadata_server`` (``remote.mooncake_metadata_server``), :meth:`Store.config` (a
:class:`~ectier.config.RemoteTierConfig` for them) and the process controls.

What is needed is installed when missing: Debian's ``libibverbs1`` (``apt-get install``, as root),
which the client library loads; the client (pip ``mooncake-transfer-engine-non-cuda``, which ships
both binaries) comes with the ``test`` extra. If it truly cannot be had, the tests that need it
are skipped with the reason; on CI (``CI=true``) that is a failure instead.

The ectier clients in tests lend no memory (``mooncake_global_segment_bytes=0``): objects live on
the store node, as on a deployment's dedicated store nodes. Teardown kills both processes and
removes their directory (logs: ``master.log`` / ``node.log`` there while they run); both get
``PR_SET_PDEATHSIG``, so a test process that crashes takes them with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from server_helpers import apt_install, die_with_parent, ensure_installed, free_port, unavailable, wait_stopped

_STARTUP_S = 30.0
NODE_SEGMENT = "768MB"  # the store node's memory for everyone's objects


def _unavailable(reason: str) -> None:
    unavailable("Mooncake tests", reason)


def _import_error() -> str:
    """'' when ``mooncake.store`` imports in a fresh interpreter, else its error."""
    done = subprocess.run([sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True,
                          timeout=120)
    return "" if done.returncode == 0 else (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1]


def _install() -> str:
    """Make ``mooncake.store`` importable (``apt-get install libibverbs1`` when it is missing);
    '' or why not."""
    error = _import_error()
    if not error or "libibverbs" not in error:
        return error and f"the Mooncake client does not import (pip install -e '.[test]'): {error}"
    why = apt_install(["libibverbs1"])
    if why:
        return f"libibverbs1 missing: {why}: {error}"
    error = _import_error()
    return f"the Mooncake client still does not import after apt-get install libibverbs1: {error}" if error else ""


def ensure_tools() -> Path:
    """The directory of the ``mooncake`` package (with its binaries), or skip/fail."""
    ensure_installed("Mooncake tests", _install)
    import mooncake
    here = Path(mooncake.__file__).parent
    missing = [b for b in ("mooncake_master", "mooncake_client") if not os.access(here / b, os.X_OK)]
    if missing:
        _unavailable(f"the mooncake package at {here} lacks {', '.join(missing)}")
    return here


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclasses.dataclass
class Proc:
    args: list[str]
    log: Path
    process: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as f:
            self.process = subprocess.Popen(self.args, stdout=f, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)

    def stop(self) -> None:
        p = self.process
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)
                p.kill()
        if p is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-800:] if self.log.exists() else ""


@dataclasses.dataclass
class Store:
    """A running ``mooncake_master`` and one store node."""

    rpc_port: int
    http_port: int
    master: Proc
    node: Proc
    address: str = "127.0.0.1"  #: where both listen
    run_in: Any = None  #: ``args -> args`` running them elsewhere (a network namespace), or None

    @property
    def master_address(self) -> str:
        return f"{self.address}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{self.address}:{self.http_port}/metadata"

    def reachable(self, port: int, http: bool = False) -> bool:
        """Whether ``port`` on :attr:`address` accepts a connection (``http``: and answers HTTP),
        seen from where the servers run."""
        if self.run_in is None:
            return _metadata_answers(port) if http else _listening(port)
        probe = (f"import socket,sys; s=socket.create_connection(({self.address!r},{port}),1); "
                 + ("s.sendall(b'GET /metadata?key=p HTTP/1.0\\r\\n\\r\\n'); sys.exit(0 if s.recv(5) else 1)"
                    if http else "sys.exit(0)"))
        try:
            return subprocess.run(self.run_in([sys.executable, "-c", probe]), capture_output=True,
                                  timeout=10).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def config(self, **kw: Any) -> Any:
        """A :class:`~ectier.config.RemoteTierConfig` for this store (``kw`` override)."""
        from ectier.config import RemoteTierConfig
        kw = {"backend": "mooncake", "addresses": self.master_address, "mooncake_metadata_server": self.metadata_server,
              "mooncake_global_segment_bytes": 0, "mooncake_local_buffer_bytes": "16MiB", **kw}
        return RemoteTierConfig(**kw)

    def remote_dict(self, **kw: Any) -> dict[str, Any]:
        """The ``remote:`` section of a config file for this store (``kw`` added)."""
        return {"backend": "mooncake", "addresses": self.master_address,
                "mooncake_metadata_server": self.metadata_server, "mooncake_global_segment_bytes": 0,
                "mooncake_local_buffer_bytes": "16MiB", **kw}

    def kill_master(self) -> None:
        """SIGKILL the master (its ports refuse connections from now on)."""
        self.master.stop()

    def pause_master(self) -> None:
        """SIGSTOP the master: it accepts connections but answers nothing (a hung master).
        Returns once every thread of it is stopped (on a loaded machine the stop can land later
        than the signal is sent)."""
        assert self.master.process is not None
        self.master.process.send_signal(signal.SIGSTOP)
        wait_stopped(self.master.process.pid)

    def resume_master(self) -> None:
        assert self.master.process is not None
        self.master.process.send_signal(signal.SIGCONT)

    def start_master(self) -> None:
        """Start the master again on its ports (empty: it keeps no metadata across restarts)."""
        self.master.stop()
        _start_master(self)


def _metadata_answers(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metadata?key=ectier-probe", timeout=1)
        return True
    except urllib.error.HTTPError:
        return True  # 404 for an unknown key: it answers
    except OSError:
        return False


def _start_master(store: Store) -> None:
    store.master.start()
    end = time.monotonic() + _STARTUP_S
    while time.monotonic() < end and store.master.process.poll() is None:
        if store.reachable(store.rpc_port) and store.reachable(store.http_port, http=True):
            return
        time.sleep(0.05)
    raise RuntimeError(f"mooncake_master on port {store.rpc_port} did not start: {store.master.tail()}")


def _start_node(store: Store) -> None:
    store.node.start()
    port = int(next(a for a in store.node.args if a.startswith("--port=")).split("=")[1])
    end = time.monotonic() + _STARTUP_S
    while time.monotonic() < end and store.node.process.poll() is None:
        if store.reachable(port) and "Starting real client service" in store.node.tail():
            return
        time.sleep(0.05)
    raise RuntimeError(f"mooncake_client (store node) on port {port} did not start: {store.node.tail()}")


@contextlib.contextmanager
def running_store(node_segment: str = NODE_SEGMENT, *, address: str = "127.0.0.1",
                  run_in: Any = None) -> Iterator[Store]:
    """Start a master and a store node for the block, then kill both and remove their directory.
    ``address``: where they listen; ``run_in``: ``args -> args`` that runs them elsewhere (e.g.
    ``netns.Host.cmd``: in a network namespace where ``address`` is)."""
    here = ensure_tools()
    wrap = run_in or (lambda *args: list(args))
    root = Path(tempfile.mkdtemp(prefix="ectier-mooncake-"))
    store: Store | None = None
    try:
        last = ""
        for _ in range(3):  # a port taken meanwhile: other ports
            rpc, http, metrics, node_port = free_port(), free_port(), free_port(), free_port()
            master = Proc(wrap(str(here / "mooncake_master"), f"--rpc_port={rpc}", f"--rpc_address={address}",
                               "--enable_http_metadata_server=true", f"--http_metadata_server_host={address}",
                               f"--http_metadata_server_port={http}", f"--metrics_host={address}",
                               f"--metrics_port={metrics}", "--logtostderr"), root / "master.log")
            node = Proc(wrap(str(here / "mooncake_client"), f"--host={address}", f"--port={node_port}",
                             f"--global_segment_size={node_segment}", f"--master_server_address={address}:{rpc}",
                             f"--metadata_server=http://{address}:{http}/metadata", "--protocol=tcp",
                             "--logtostderr"), root / "node.log")
            store = Store(rpc, http, master, node, address, None if run_in is None else (lambda a: run_in(*a)))
            try:
                _start_master(store)
                _start_node(store)
                break
            except RuntimeError as exc:
                last = str(exc)
                node.stop()
                master.stop()
                store = None
        if store is None:
            raise RuntimeError(last)
        yield store
    finally:
        if store is not None:
            store.node.stop()
            store.master.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def mooncake_store() -> Iterator[Store]:
    """A master and a store node on loopback for the session (do not kill them)."""
    with running_store() as store:
        yield store


@pytest.fixture
def mooncake_store_fn() -> Iterator[Store]:
    """A fresh master and store node for one test (which may kill, pause or restart the master)."""
    with running_store() as store:
        yield store
