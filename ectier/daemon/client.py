"""Client of the ectier daemon: control calls over the Unix socket, tensor bytes through shm.

No daemon internals are imported here, and torch is imported only by the data calls
(``put``/``get``), so control calls (``contains``, ``delete``, ``stats``, ``ping``) work without
torch.

The client reconnects by itself: when the daemon restarts, the next call opens a new connection,
repeats the handshake and maps the new arena, then retries the call once. One client object may
be shared by threads (calls are serialised on its connection); give busy threads their own client.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import threading
import time
from typing import Any

from .. import errors
from ..config import DaemonConfig
from ..entry import validate_key, validate_namespace
from .protocol import PROTOCOL_VERSION, FrameDecoder, ProtocolError, encode_frame

__all__ = ["DaemonClient", "DaemonUnavailableError"]

log = logging.getLogger(__name__)


class DaemonUnavailableError(errors.EctierError):
    """The daemon's socket cannot be reached (not running, wrong path, refused this user)."""


class DaemonClient:
    """Talk to ``ectier serve``.

    Args:
        socket_path: the daemon's socket; ``None`` = the default of :class:`~ectier.config.DaemonConfig`.
        client_name: shown in ``ectier stats`` (default ``"<program>:<pid>"``).
        timeout_s: socket timeout per call, seconds.
        connect_retry_s: how long a call keeps retrying to connect to a daemon that went away
            (a restart); a client whose last connection attempt failed fails fast instead (see
            ``backoff_s``).
        backoff_s: after a failed connection attempt, calls raise :class:`DaemonUnavailableError`
            at once, without trying to connect, for this many seconds; after that each call makes
            one immediate attempt (no ``connect_retry_s`` wait) until one succeeds. So an
            unreachable daemon (down, wrong ``socket_path``) costs a caller at most one
            ``connect_retry_s`` wait, not one per call.

    Errors raised by calls: the daemon's typed errors map back onto :mod:`ectier.errors` classes
    (``InvalidKeyError``, ``EntryTooLargeError``, ...); protocol violations raise
    :class:`~ectier.daemon.protocol.ProtocolError`; an unreachable daemon raises
    :class:`DaemonUnavailableError`.
    """

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        client_name: str | None = None,
        timeout_s: float = 30.0,
        connect_retry_s: float = 5.0,
        backoff_s: float = 1.0,
    ) -> None:
        self.socket_path = socket_path or DaemonConfig().resolved_socket_path()
        self.client_name = client_name or f"{os.path.basename(os.sys.argv[0] or 'python')}:{os.getpid()}"
        self.timeout_s = timeout_s
        self.connect_retry_s = connect_retry_s
        self.backoff_s = backoff_s
        # monotonic time of the last failed connection attempt (None: the last one succeeded, or
        # none was made yet); while set, calls fail fast instead of waiting connect_retry_s
        self._failed_at: float | None = None
        self._sock: socket.socket | None = None
        self._decoder = FrameDecoder(1 << 30)
        self._lock = threading.RLock()
        self._next_id = 1
        self.server_info: dict[str, Any] = {}
        self._arena_mmap: mmap.mmap | None = None
        self._arena = None  # torch uint8 tensor over the mapping, made on first data call
        self._arena_path: str | None = None

    # ---------------------------------------------------------------------------- connection

    def connect(self, *, wait: bool = True) -> None:
        """Connect and handshake now (calls do this lazily). Raises DaemonUnavailableError.

        ``wait=False``: one attempt, no ``connect_retry_s`` wait (a start-up probe); a failure
        starts the back-off window like any other."""
        with self._lock:
            if self._sock is None:
                self._connect(wait=wait)

    @property
    def unreachable(self) -> bool:
        """True while the last connection attempt failed (calls then fail fast)."""
        return self._failed_at is not None

    def _connect(self, *, wait: bool = True) -> None:
        now = time.monotonic()
        if self._failed_at is not None:
            if now - self._failed_at < self.backoff_s:
                raise DaemonUnavailableError(
                    f"cannot reach the ectier daemon at {self.socket_path!r} (failed "
                    f"{now - self._failed_at:.2f} s ago; next attempt after {self.backoff_s:g} s); "
                    "is `ectier serve` running (daemon.socket_path)?"
                )
            wait = False  # known down: one attempt per back-off window, never a retry wait
        deadline = now + (self.connect_retry_s if wait else 0.0)
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(self.socket_path)
                break
            except OSError as exc:
                sock.close()
                if time.monotonic() >= deadline:
                    self._failed_at = time.monotonic()
                    # the daemon whose arena we map is gone: let go of its (unlinked) file now, or
                    # its pages stay allocated in daemon.shm_dir and a restarted daemon may find
                    # no room for its own arena
                    self._unmap()
                    raise DaemonUnavailableError(
                        f"cannot reach the ectier daemon at {self.socket_path!r}: {exc.strerror or exc}; "
                        "is `ectier serve` running (daemon.socket_path)?"
                    ) from None
                time.sleep(0.05)
        self._failed_at = None
        self._sock = sock
        self._decoder = FrameDecoder(1 << 30)
        try:
            info = self._roundtrip({"op": "hello", "version": PROTOCOL_VERSION, "client": self.client_name})
        except BaseException:
            self._drop()
            raise
        self.server_info = info
        # always map the arena afresh on a new connection: a restarted daemon may create its
        # arena under the old name (same pid, e.g. PID 1 of a container), and the old mapping
        # would then be an unlinked file the daemon no longer reads
        self._unmap()

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock = None

    def _unmap(self) -> None:
        if getattr(self, "_arena_registered", False) and self._arena is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._arena.data_ptr())
            self._arena_registered = False
        self._arena = None
        if self._arena_mmap is not None:
            try:
                self._arena_mmap.close()
            except BufferError:
                pass  # a tensor view still exists; the mapping goes with it
            self._arena_mmap = None
        self._arena_path = None

    def close(self) -> None:
        """Close the connection (leases held by this client are released by the daemon)."""
        with self._lock:
            self._drop()
            self._unmap()

    def __enter__(self) -> "DaemonClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _roundtrip(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self._sock is not None
        rid = self._next_id
        self._next_id += 1
        try:
            frame = encode_frame({"id": rid, **request})
        except UnicodeEncodeError as exc:  # a lone surrogate: the cache refuses such keys too
            raise errors.InvalidKeyError(f"{request.get('op')}: strings must be valid UTF-8: {exc}") from None
        self._sock.sendall(frame)
        while True:
            data = self._sock.recv(65536)
            if not data:
                raise ConnectionResetError("daemon closed the connection")
            for msg in self._decoder.feed(data):
                if isinstance(msg, ProtocolError):
                    raise msg
                if msg.get("id") not in (rid, None):
                    continue
                if not msg.get("ok"):
                    raise _error_from(msg.get("error") or {})
                msg.pop("id", None)
                msg.pop("ok", None)
                return msg

    def call(self, op: str, *, retry: bool = True, **args: Any) -> dict[str, Any]:
        """Send one request and return its results; reconnects (and retries once) if the daemon
        went away. Raises the daemon's typed error on an error reply."""
        if "key" in args:
            validate_key(args["key"])
        if "namespace" in args:
            validate_namespace(args["namespace"])
        with self._lock:
            for attempt in (0, 1):
                try:
                    if self._sock is None:
                        self._connect()
                    return self._roundtrip({"op": op, **args})
                except (ConnectionError, BrokenPipeError, socket.timeout, OSError) as exc:
                    self._drop()
                    if isinstance(exc, DaemonUnavailableError) or attempt == 1 or not retry:
                        if isinstance(exc, errors.EctierError):
                            raise
                        raise DaemonUnavailableError(f"lost the ectier daemon at {self.socket_path!r}: {exc}") from None
            raise AssertionError("unreachable")

    # --------------------------------------------------------------------------- control calls

    def ping(self) -> float:
        """Round-trip time of one ``ping``, seconds."""
        t0 = time.perf_counter()
        self.call("ping")
        return time.perf_counter() - t0

    def contains(self, key: str, *, namespace: str | None = None) -> bool:
        """True if the daemon stores ``key``. Never renews any lease."""
        return self.call("contains", key=key, **_ns(namespace))["found"]

    def delete(self, key: str, *, namespace: str | None = None) -> bool:
        """Remove ``key`` from every tier; True if it was stored."""
        return self.call("delete", key=key, **_ns(namespace))["deleted"]

    def stats(self) -> dict[str, Any]:
        """The daemon's stats: tiers, bytes, hits/misses/evictions, clients, leases."""
        return self.call("stats")["stats"]

    # ------------------------------------------------------------------------------ data calls

    def _arena_tensor(self):
        import torch

        if self._arena is None:
            arena = self.server_info["arena"]
            fd = os.open(arena["path"], os.O_RDWR)
            try:
                self._arena_mmap = mmap.mmap(fd, arena["nbytes"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            self._arena = torch.frombuffer(self._arena_mmap, dtype=torch.uint8) if arena["nbytes"] else torch.empty(0, dtype=torch.uint8)
            self._arena_path = arena["path"]
            self._register_arena(torch)
        return self._arena

    def _register_arena(self, torch) -> None:
        """On a CUDA machine, page-lock this process's mapping of the arena (``cudaHostRegister``)
        so that copies between the GPU and the arena are pinned DMA with no staging copy.
        Failure only costs speed: it is logged and the mapping stays pageable."""
        self._arena_registered = False
        if self._arena is None or self._arena.numel() == 0 or not torch.cuda.is_available():
            return
        rc = torch.cuda.cudart().cudaHostRegister(self._arena.data_ptr(), self._arena.numel(), 0)
        ok = (rc.value if hasattr(rc, "value") else int(rc)) == 0
        if not ok:
            log.warning("cudaHostRegister of the daemon's arena failed (%s); GPU copies stay pageable", rc)
        self._arena_registered = ok

    def put(self, key: str, tensor, *, namespace: str | None = None) -> None:
        """Store ``tensor`` under ``key``: reserve arena space, copy into it, commit.

        Raises:
            InvalidKeyError, InvalidTensorError, EntryTooLargeError, TierWriteError: as
            :meth:`ectier.TieredCache.put`. DaemonUnavailableError: daemon unreachable.
        """
        from ..tensors import byte_view, meta_for

        meta = meta_for("-", "-", tensor)  # dtype and shape; the daemon validates key/namespace
        src = byte_view(tensor)
        if src.device.type != "cpu":
            src = src.cpu()
        with self._lock:
            for attempt in (0, 1):
                reply = self.call("reserve", key=key, dtype=meta.dtype, shape=list(meta.shape), **_ns(namespace))
                lease = reply["lease"]
                try:
                    arena = self._arena_tensor()
                    off = 0
                    for start, length in reply["extents"]:
                        arena[start : start + length].copy_(src[off : off + length])
                        off += length
                    self.call("commit", retry=False, lease=lease)
                    return
                except DaemonUnavailableError:
                    if attempt == 1:
                        raise  # the daemon restarted mid-put twice; give up
                except BaseException:
                    try:
                        self.call("abort", retry=False, lease=lease)
                    except errors.EctierError:
                        pass
                    raise

    def get(self, key: str, *, namespace: str | None = None, device: str | None = None):
        """A copy of the entry under ``key`` (shape and dtype as put), or ``None`` on a miss.

        ``device``: ``None``/``"cpu"`` or an explicit ``"cuda:<index>"``.
        """
        import torch

        from ..tensors import parse_device, torch_dtype

        dev = parse_device(device)
        with self._lock:
            reply = self.call("get", key=key, **_ns(namespace))
            if not reply["hit"]:
                return None
            out = torch.empty(reply["nbytes"], dtype=torch.uint8)
            try:
                arena = self._arena_tensor()
                off = 0
                for start, length in reply["extents"]:
                    out[off : off + length].copy_(arena[start : start + length])
                    off += length
            finally:
                try:
                    valid = self.call("release", retry=False, lease=reply["lease"])["valid"]
                except DaemonUnavailableError:
                    # the daemon closes the connection of a client whose lease expired (or went
                    # away): either way the copy cannot be vouched for
                    valid = False
            if not valid:
                return None  # the lease expired while copying: the bytes may be foreign
            dtype = torch_dtype(reply["dtype"])
            shape = tuple(reply["shape"])
            tensor = out.view(dtype).view(shape) if reply["nbytes"] else torch.empty(shape, dtype=dtype)
            return tensor if dev.type == "cpu" else tensor.to(dev)


def _ns(namespace: str | None) -> dict[str, str]:
    return {} if namespace is None else {"namespace": namespace}


def _error_from(error: dict[str, Any]) -> Exception:
    name = str(error.get("type", "EctierError"))
    message = str(error.get("message", "daemon error"))
    if name == "ProtocolError":
        return ProtocolError(message)
    if name == "PermissionError":
        return DaemonUnavailableError(f"the daemon refused this client: {message}")
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.EctierError):
        return cls(message)
    return errors.EctierError(f"{name}: {message}")
