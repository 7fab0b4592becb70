"""How the Mooncake backend runs client calls: each on a daemon thread, the caller waiting at most
its deadline (:class:`Runner`); buffers of failed transfers kept alive for a while (:class:`Holds`);
Mooncake's return codes by name; the checks of a call's arguments; the probe of a master before a
setup (:func:`unreachable`); the time left for a put's next path (:func:`time_left`); the import of
Mooncake's client (:func:`import_store`). Used by
``ectier/tiers/remote/mooncake.py`` only."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

from ...errors import ConfigError
from .backend import RemoteTimeout

__all__ = ["Runner", "Holds", "code", "check_args", "route_address", "unreachable", "ERROR_NAMES", "MAX_IN_FLIGHT",
           "HOLD_S", "HOLD_CAP_BYTES", "time_left", "import_store"]

log = logging.getLogger("ectier.tiers.remote.mooncake")

#: Mooncake client calls running at once (late ones included)
MAX_IN_FLIGHT = 16

#: Mooncake's ErrorCode values (mooncake-store/include/types.h) that the backend names
ERROR_NAMES = {
    -1: "INTERNAL_ERROR", -200: "NO_AVAILABLE_HANDLE", -600: "INVALID_PARAMS", -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS", -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL", -900: "RPC_FAIL", -901: "RPC_TIMEOUT",
}
#: a buffer whose transfer failed (TRANSFER_FAIL, ...) is kept this long before it is unregistered
#: and freed (its transfer may still be in flight), and while more than HOLD_CAP_BYTES are kept,
#: calls fail at once (RemoteError) rather than hold more
HOLD_S = 60.0
HOLD_CAP_BYTES = 1 << 30


def code(rc: int) -> str:
    """``NAME (rc)`` of a Mooncake return code."""
    return f"{ERROR_NAMES.get(rc, 'error')} ({rc})"


class Holds:
    """Buffers of failed transfers, kept registered and alive for :data:`HOLD_S` seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[tuple[float, int, int, Any]] = []  # (until, ptr, nbytes, owner)
        self.nbytes = 0

    def hold(self, rc: int, ptr: int, nbytes: int, owner: Any) -> None:
        """Keep ``owner`` (the buffer at ``ptr``, registered unless 0) after a failure ``rc``."""
        with self._lock:
            self._items.append((time.monotonic() + HOLD_S, ptr, nbytes, owner))
            self.nbytes += nbytes
            held = self.nbytes
        log.debug("mooncake: the buffer of a failed transfer (%s) is kept for %g s (%d bytes kept)", code(rc),
                  HOLD_S, held)

    def release_expired(self, store: Any) -> None:
        """Unregister and drop the buffers kept long enough (on a call thread: may block)."""
        now = time.monotonic()
        with self._lock:
            done = [h for h in self._items if h[0] <= now]
            self._items = [h for h in self._items if h[0] > now]
            self.nbytes -= sum(h[2] for h in done)
        for _, ptr, _, _ in done:
            if ptr:
                store.unregister_buffer(ptr)

    def full(self) -> bool:
        """More than :data:`HOLD_CAP_BYTES` kept and not yet past :data:`HOLD_S` (those past it
        are unregistered and dropped by the next call)."""
        now = time.monotonic()
        with self._lock:
            return sum(h[2] for h in self._items if h[0] > now) > HOLD_CAP_BYTES


class Runner:
    """Runs blocking client calls on daemon threads; the caller waits at most its deadline."""

    def __init__(self, slots: int) -> None:
        self._slots = threading.BoundedSemaphore(slots)
        self.late = 0  # calls whose caller gave up and that still run
        self._lock = threading.Lock()

    def run(self, what: str, fn: Callable[[], Any], end: float, seconds: float, done: Callable[[], None]) -> Any:
        """``fn()`` on a daemon thread, waiting until ``end`` (monotonic seconds); ``done()`` runs
        once the call ended (on its thread), or at once when it never started."""
        if not self._slots.acquire(timeout=max(0.0, end - time.monotonic())):
            done()
            raise RemoteTimeout(f"mooncake {what}: no free call slot within the deadline of {seconds:g} s "
                                f"({self.late} late calls still running)")
        fut: Future = Future()
        waiting = [True]

        def body() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)
            finally:
                with self._lock:
                    if not waiting[0]:
                        self.late -= 1
                self._slots.release()
                done()

        threading.Thread(target=body, name="ectier-mooncake", daemon=True).start()
        try:
            return fut.result(timeout=max(0.0, end - time.monotonic()))
        except FutureTimeout:
            with self._lock:
                if not fut.done():
                    waiting[0] = False
                    self.late += 1
            if fut.done():
                return fut.result()
            raise RemoteTimeout(f"mooncake {what}: past its deadline of {seconds:g} s") from None


def check_args(key: Any, deadline_s: Any) -> None:
    """Raises ValueError naming ``key`` (not a non-empty str) or ``deadline_s`` (not seconds > 0)."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"key: expected a non-empty str, got {key!r}")
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not deadline_s > 0:
        raise ValueError(f"deadline_s: expected seconds > 0, got {deadline_s!r}")


def route_address(host: str, port: int) -> str:
    """The local address of the route to ``host:port`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the probe goes straight


def unreachable(master: str, metadata: str, timeout_s: float) -> str:
    """'' when ``master`` (``host:port``) accepts a connection and the HTTP metadata server
    ``metadata`` answers (within ``timeout_s`` seconds each; a non-HTTP one is not probed), else why not."""
    host, _, port = master.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        return f"master {master} does not accept connections: {exc}"
    if metadata.startswith(("http://", "https://")):
        try:
            _NO_PROXY.open(f"{metadata}?key=ectier-probe", timeout=timeout_s).close()
        except urllib.error.HTTPError:
            pass  # an answer (404 for the unknown key)
        except OSError as exc:
            return f"metadata server {metadata} does not answer: {exc}"
    return ""


def time_left(end: float, why: str) -> float:
    """The seconds left before ``end`` (monotonic) for a put's next path. Raises RemoteTimeout."""
    left = end - time.monotonic()
    if left <= 0:
        raise RemoteTimeout(f"mooncake put: past its deadline ({why})")
    return left


def import_store() -> Callable[[], Any]:
    """Mooncake's ``MooncakeDistributedStore`` class (its client's INFO logging off).

    Raises:
        ConfigError: the Mooncake client is not installed (names ``remote.backend``)."""
    os.environ.setdefault("GLOG_minloglevel", "1")  # the client's INFO lines; warnings still show
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ConfigError("remote.backend: 'mooncake' needs the Mooncake client: pip install 'ectier[mooncake]' "
                          f"(and Debian's libibverbs1: apt-get install libibverbs1): {exc}") from None
    return MooncakeDistributedStore
