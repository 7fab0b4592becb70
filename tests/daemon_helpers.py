"""Helpers of the daemon tests: daemon processes, spawn-safe child jobs (raw protocol connections: daemon_rawconn.py).

Every daemon runs as a real process (``ectier serve``'s code) on a socket
in a short temporary directory under ``/tmp`` (AF_UNIX paths are limited to 107 bytes), with its
host arena (``daemon.shm_dir``) and NVMe store in the same directory, so nothing is left in
``/dev/shm``. :class:`DaemonProcess` objects are registered and killed at interpreter exit if a
test forgot them; fixtures stop them in ``finally`` blocks. The daemons that several test modules
share are context managers here (:func:`main_daemon_process`, :func:`restricted_daemon_process`),
each module wrapping them in its own module-scoped fixture. Most daemons are forked from one
server process that has imported ectier and torch already (``fork_helpers.FORKSERVER``), so a
daemon starts in a fraction of a second instead of an interpreter start and a torch import each
(seconds on CI's 2 cores); ``via="exec"`` and ``via="script"`` start a fresh interpreter (``python
-m ectier.daemon``, the ``ectier`` console script), as an operator does. The exception to "a real
process": :func:`serve_in_thread`, a server in a thread of the test process, for tests that look inside it.

The child jobs (:func:`producer`, :func:`consumer`, :func:`die_holding_reservation`,
:func:`die_holding_get_lease`) are module-level functions so that a ``spawn`` multiprocessing
context can import them; they take seeds and specs, never tensors, and import torch lazily.
"""

from __future__ import annotations

import atexit
import contextlib
import grp
import hashlib
import json
import math
import mmap
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from fork_helpers import FORKSERVER, ForkedProcess, forked_daemon
from daemon_rawconn import RawConn  # noqa: F401  (re-exported for the daemon tests)
from server_helpers import wait_stopped  # noqa: F401  (re-exported for the daemon tests)

from ectier.daemon.protocol import ProtocolError

KiB = 1 << 10
MiB = 1 << 20

PYTHON = sys.executable
ECTIER_SCRIPT = str(Path(sys.executable).with_name("ectier"))

_LIVE: list["DaemonProcess"] = []


def short_tmpdir() -> str:
    """A fresh directory like ``/tmp/ectXXXXXX`` (short enough for socket paths)."""
    return tempfile.mkdtemp(prefix="ect", dir="/tmp")


def clean_env() -> dict[str, str]:
    """The environment minus ECTIER_* overrides (a developer's shell must not change the tests)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ECTIER_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def daemon_config(directory: str, *, host_bytes: int = 16 * MiB, block_bytes: int = 64 * KiB,
                  nvme: bool = True, nvme_bytes: int = 64 * MiB, write_through: bool = False,
                  flush_on_close: bool = True, namespace: str = "test", **daemon: Any) -> dict[str, Any]:
    """A config mapping for a daemon living in ``directory`` (socket ``d.sock``, arena, NVMe)."""
    daemon.setdefault("socket_path", os.path.join(directory, "d.sock"))
    daemon.setdefault("shm_dir", directory)
    cfg: dict[str, Any] = {
        "namespace": namespace,
        "host": {"capacity_bytes": host_bytes, "block_bytes": block_bytes, "pin_memory": False,
                 "admit_wait_s": 0.5},
        "daemon": daemon,
    }
    if nvme:
        cfg["nvme"] = {"path": os.path.join(directory, "nvme"), "capacity_bytes": nvme_bytes, "sync": False,
                       "write_through": write_through, "flush_on_close": flush_on_close,
                       "map_initial_bytes": 4 * MiB}
    return cfg


def write_config(path: str, cfg: dict[str, Any]) -> str:
    """Write ``cfg`` as YAML or JSON (by suffix); returns ``path``."""
    with open(path, "w") as f:
        if path.endswith((".yaml", ".yml")):
            import yaml

            yaml.safe_dump(cfg, f)
        else:
            json.dump(cfg, f)
    return path


class DaemonProcess:
    """One daemon process. ``via``: ``"module"`` (``python -m ectier.daemon``'s code, forked by
    :data:`FORKSERVER`), ``"exec"`` (a fresh ``python -m ectier.daemon``), ``"script"`` (the
    ``ectier serve`` console script) or ``"slow-nvme"`` (``tests/slow_nvme_daemon.py``, forked:
    every NVMe payload read ``nvme_read_delay_s`` late). ``nofile``: the process's ``(soft, hard)``
    ``RLIMIT_NOFILE``, set before it starts (``exec`` and ``script`` only)."""

    def __init__(self, config_path: str, socket_path: str, *, via: str = "module",
                 nvme_read_delay_s: float = 0.0, nofile: tuple[int, int] | None = None) -> None:
        if via not in ("module", "exec", "script", "slow-nvme"):
            raise ValueError(f"via: {via!r} is not module, exec, script or slow-nvme")
        if nofile is not None and via not in ("exec", "script"):
            raise ValueError(f"nofile: only a launched daemon (via exec or script) takes it, not via {via!r}")
        self.nofile = nofile
        self.config_path = config_path
        self.socket_path = socket_path
        self.via = via
        self.nvme_read_delay_s = nvme_read_delay_s
        self.log_path = os.path.join(os.path.dirname(config_path), f"daemon-{len(_LIVE)}-{time.monotonic_ns()}.log")
        self.proc: subprocess.Popen | ForkedProcess | None = None

    def launch(self) -> "DaemonProcess":
        """Start the process (returns at once; see :meth:`wait_ready`)."""
        self._log = open(self.log_path, "wb")
        if self.via in ("module", "slow-nvme"):
            argv = (["slow-nvme", self.config_path, str(self.nvme_read_delay_s)] if self.via == "slow-nvme"
                    else ["--config", self.config_path])
            process = FORKSERVER.Process(target=forked_daemon, args=(argv, self.log_path, os.getcwd(), clean_env()),
                                         daemon=True)
            process.start()
            self.proc = ForkedProcess(process)
        else:
            cmd = ([ECTIER_SCRIPT, "serve", "--config", self.config_path] if self.via == "script"
                   else [PYTHON, "-m", "ectier.daemon", "--config", self.config_path])
            nofile = self.nofile
            limit = None if nofile is None else (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, nofile))
            self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=clean_env(),
                                         stdin=subprocess.DEVNULL, preexec_fn=limit)
        _LIVE.append(self)
        return self

    def wait_ready(self, timeout: float = 30.0) -> "DaemonProcess":
        """Wait until the daemon answers a ping on its socket (fails fast, with the log, if it dies)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with RawConn(self.socket_path, timeout=2.0) as c:
                    if c.request({"id": 1, "op": "ping"}).get("ok"):
                        return self
            except (OSError, ConnectionError, ProtocolError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon not ready after {timeout} s:\n{self.log()}")
            time.sleep(0.02)

    def start(self, timeout: float = 30.0) -> "DaemonProcess":
        return self.launch().wait_ready(timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait; returns the exit code (SIGKILL if it does not stop in ``timeout``)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise AssertionError(f"daemon ignored SIGTERM for {timeout} s:\n{self.log()}") from None

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(10)

    def stop(self) -> None:
        """Make sure the process is gone: SIGTERM, then SIGKILL after a few seconds."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self.kill9()
        try:
            self._log.close()
        except Exception:
            pass
        if self in _LIVE:
            _LIVE.remove(self)


@atexit.register
def _kill_leftovers() -> None:  # a last resort if a fixture could not run its finally block
    for d in list(_LIVE):
        try:
            if d.proc is not None and d.proc.poll() is None:
                d.proc.kill()
        except Exception:
            pass


def remove_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------- the daemons of the test modules

#: the multiprocessing context of client processes (they receive seeds, never tensors): a fresh
#: process as with "spawn" (no state of the test process), forked by :data:`FORKSERVER` so that it
#: does not import torch again
SPAWN = FORKSERVER
IS_ROOT = os.geteuid() == 0


def nogroup() -> str | None:
    """The name of group 65534 (``nogroup``/``nobody``), or None if there is none."""
    try:
        return grp.getgrgid(65534).gr_name
    except KeyError:
        return None


@contextlib.contextmanager
def daemon_process(config_name: str = "cfg.json", *, via: str = "module", nofile: tuple[int, int] | None = None,
                   nvme_read_delay_s: float = 0.0, edit: Callable[[dict], None] | None = None,
                   dir_mode: int | None = None, **config: Any) -> Iterator[DaemonProcess]:
    """A started daemon of ``daemon_config(<fresh directory>, **config)`` (``edit``: changes that
    mapping first; ``dir_mode``: the directory's mode), its config written to ``config_name``
    there, launched as :class:`DaemonProcess` takes ``via`` / ``nofile`` / ``nvme_read_delay_s``.
    Yields the process with ``.dir``, ``.cfg`` and ``.path`` (the config file); stopped and its
    directory removed after."""
    d = short_tmpdir()
    try:
        if dir_mode is not None:
            os.chmod(d, dir_mode)
        cfg = daemon_config(d, **config)
        if edit is not None:
            edit(cfg)
        path = write_config(os.path.join(d, config_name), cfg)
        proc = DaemonProcess(path, cfg["daemon"]["socket_path"], via=via, nofile=nofile,
                             nvme_read_delay_s=nvme_read_delay_s)
        proc.dir, proc.cfg, proc.path = d, cfg, path
        try:
            yield proc.start()
        finally:
            proc.stop()
    finally:
        remove_dir(d)


@contextlib.contextmanager
def main_daemon_process() -> Iterator[DaemonProcess]:
    """The ``main`` daemon (via the ``ectier`` script): 32 MiB host, 64 MiB NVMe, metrics on an
    ephemeral port, 64 KiB frame cap, default lease (30 s). Yields the running process, with
    ``.dir`` (its directory) and ``.cfg`` (its config mapping); stopped and removed after."""
    with daemon_process("cfg.yaml", via="script", host_bytes=32 * MiB, nvme_bytes=64 * MiB, metrics_port=0,
                        max_frame_bytes=64 * KiB) as proc:
        yield proc


@contextlib.contextmanager
def host_daemon_process(host_bytes: int, config_name: str = "daemon.json", **daemon: Any) -> Iterator[DaemonProcess]:
    """A started daemon with a host tier of ``host_bytes``, no NVMe and the ``daemon`` knobs given;
    after the test it is continued (a test may have stopped it with SIGSTOP), stopped and its
    directory removed."""
    with daemon_process(config_name, host_bytes=host_bytes, nvme=False, **daemon) as proc:
        try:
            yield proc
        finally:
            with contextlib.suppress(ProcessLookupError):  # a test may have killed it
                os.kill(proc.pid, signal.SIGCONT)


@contextlib.contextmanager
def restricted_daemon_process() -> Iterator[DaemonProcess]:
    """The ``restricted`` daemon: 8 MiB host, no NVMe, lease_s 0.5, max_clients 4, socket mode
    0660 (group :func:`nogroup` when run as root: ``.group``, else None). Its directory is 0711,
    so the socket's own mode decides who may connect."""
    group = nogroup() if IS_ROOT else None
    # other users may traverse (not list) the directory: the socket's own mode decides
    with daemon_process(dir_mode=0o711, host_bytes=8 * MiB, nvme=False, lease_s=0.5, max_clients=4,
                        socket_mode="0660", allowed_group=group) as proc:
        proc.group = group
        yield proc


def serve_in_thread(cfg):
    """A started :class:`~ectier.daemon.server.DaemonServer` for ``cfg`` (a ``CacheConfig``) serving
    in a daemon thread of this process; returns ``(server, thread)``: stop with
    ``server.stop(); thread.join(10)``."""
    from ectier.daemon.server import DaemonServer

    server = DaemonServer(cfg)
    server.start()
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    return server, t


def daemon_stats(socket_path: str) -> dict[str, Any]:
    """``stats`` over a fresh raw connection (does not use DaemonClient)."""
    with RawConn(socket_path) as c:
        r = c.request({"id": 1, "op": "stats"})
    assert r["ok"], r
    return r["stats"]


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.02, what: str = "condition"):
    """Poll ``predicate()`` until truthy; returns its value or fails naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def idle(socket_path: str, *, absent: tuple[str, ...] = (), orphans: int = 0) -> dict[str, Any]:
    """Wait until the daemon holds no leases, ``orphans`` orphaned put reservations (those of a
    killed client end once the daemon's reaper sees its process gone) and no client named in
    ``absent`` is connected; returns those stats."""
    def check():
        s = daemon_stats(socket_path)
        d = s["daemon"]
        names = {c["name"] for c in d["clients"]}
        return s if (d["leases"] == {"put": 0, "get": 0} and d["orphaned_puts"]["leases"] == orphans
                     and not names & set(absent)) else None
    return wait_for(check, what="the daemon to hold no leases")


def write_arena(arena_path: str, extents: list[list[int]], data: bytes) -> None:
    """Copy ``data`` into the arena file at ``extents`` (no torch)."""
    with open(arena_path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        m = mmap.mmap(f.fileno(), size)
        try:
            off = 0
            for start, length in extents:
                n = min(length, len(data) - off)
                if n <= 0:
                    break
                m[start:start + n] = data[off:off + n]
                off += n
        finally:
            m.close()


# ------------------------------------------------------------------------------ tensors


def make_tensor(seed: int, dtype: str, shape: tuple[int, ...]):
    """A deterministic tensor with random bytes (every bit pattern; bool is 0/1)."""
    import torch

    tdtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if tdtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=tdtype).element_size()
    b = torch.randint(0, 256, (n * itemsize,), generator=g, dtype=torch.uint8)
    return b.view(tdtype).reshape(shape)


def raw_bytes(t) -> bytes:
    """A tensor's logical C-order content as bytes (independent of strides)."""
    import torch

    flat = torch.empty(t.shape, dtype=t.dtype)
    flat.copy_(t)
    return flat.reshape(-1).view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def assert_same(got, expected) -> None:
    """``got`` (a tensor, or None for a miss) has ``expected``'s dtype, shape and bytes."""
    assert got is not None, "miss"
    assert got.dtype == expected.dtype
    assert tuple(got.shape) == tuple(expected.shape)
    assert raw_bytes(got) == raw_bytes(expected)


def tensor_digest(t) -> str:
    """dtype, shape and a hash of the bytes: equal digests = byte-identical tensors."""
    return f"{str(t.dtype).removeprefix('torch.')}{tuple(t.shape)}:{hashlib.sha256(raw_bytes(t)).hexdigest()}"


def spec_digest(spec: tuple[str, int, str, tuple[int, ...]]) -> str:
    _key, seed, dtype, shape = spec
    return tensor_digest(make_tensor(seed, dtype, tuple(shape)))


# ------------------------------------------------------------------------ spawn child jobs


def producer(socket_path: str, specs: list, done, hot: list | None = None, stop=None) -> None:
    """Put every ``(key, seed, dtype, shape)`` spec, then set ``done``. With ``hot`` (two specs of
    one key), keep overwriting that key with one then the other until ``stop`` is set."""
    from ectier.daemon.client import DaemonClient

    with DaemonClient(socket_path, client_name="producer") as c:
        for key, seed, dtype, shape in specs:
            c.put(key, make_tensor(seed, dtype, tuple(shape)))
        if hot:
            versions = [(k, make_tensor(seed, dtype, tuple(shape))) for k, seed, dtype, shape in hot]
            c.put(*versions[0])
        done.set()
        i = 1
        deadline = time.monotonic() + 60
        while hot and not stop.is_set() and time.monotonic() < deadline:
            c.put(*versions[i % 2])
            i += 1


def consumer(socket_path: str, keys: list[str], rounds: int, done, barrier, results) -> None:
    """After the producer is done, meet the other consumer at ``barrier``, then get every key
    ``rounds`` times; report ``{key: sorted set of digests seen}`` (a miss is ``"miss"``)."""
    from ectier.daemon.client import DaemonClient

    seen: dict[str, set[str]] = {k: set() for k in keys}
    with DaemonClient(socket_path, client_name=f"consumer:{os.getpid()}") as c:
        c.connect()
        if not done.wait(60):
            results.put(("error", "producer did not finish"))
            return
        barrier.wait(60)
        for r in range(rounds):
            order = keys if r % 2 == 0 else list(reversed(keys))
            for key in order:
                t = c.get(key)
                seen[key].add("miss" if t is None else tensor_digest(t))
    results.put(("ok", {k: sorted(v) for k, v in seen.items()}))


def die_holding_reservation(socket_path: str, key: str, nbytes: int, ready) -> None:
    """Reserve ``nbytes`` under ``key`` (low level), write half of them, then SIGKILL itself."""
    from ectier.daemon.client import DaemonClient

    c = DaemonClient(socket_path, client_name="doomed-put")
    r = c.call("reserve", key=key, dtype="uint8", shape=[nbytes])
    write_arena(c.server_info["arena"]["path"], r["extents"], b"\xab" * (nbytes // 2))
    ready.set()
    time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)


def die_holding_get_lease(socket_path: str, key: str, ready) -> None:
    """Take a get lease on ``key`` (low level), then SIGKILL itself without releasing it."""
    from ectier.daemon.client import DaemonClient

    c = DaemonClient(socket_path, client_name="doomed-get")
    r = c.call("get", key=key)
    assert r["hit"], r
    ready.set()
    time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)



def stop_process(pid: int, within_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped (:func:`wait_stopped`): on a
    loaded machine the stop can land after a request sent right after the signal was answered."""
    os.kill(pid, signal.SIGSTOP)
    wait_stopped(pid, within_s)
