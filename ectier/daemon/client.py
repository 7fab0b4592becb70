"""Client of the ectier daemon: control calls over the Unix socket, tensor bytes through shm.

The connection itself (connect, handshake, back-off, round trips, requests sent without waiting:
``submit``/``poll``) is :mod:`ectier.daemon.client_conn`; zero-copy views are
:mod:`ectier.daemon.client_views`; this module holds the control and data calls.

No daemon internals are imported here, and torch is imported only by the data calls
(``put``/``get``), so control calls (``contains``, ``delete``, ``stats``, ``ping``) work without
torch.

The client reconnects by itself: when the daemon restarts, the next call opens a new connection,
repeats the handshake (``hello``, always the first request on a connection) and maps the new
arena, then retries the call once. A connection the daemon closed while it was idle
(``daemon.idle_timeout_s``, or to make room for a new client) is replaced before the next call
is sent; the arena mapping is kept when the daemon is the same. A daemon that does not answer
within ``timeout_s`` (hung, stopped) is treated like an unreachable one: the call fails, is not
retried, and the back-off starts. One client object may be shared by threads (calls are
serialised on its connection); give busy threads their own client.

What the daemon offers beyond protocol 1's first operations is in its ``hello`` reply
(:attr:`DaemonClient.features`): the batched :meth:`DaemonClient.prefetch`, and direct reads and
writes through scratch files for entries the host arena cannot take (``put``/``get`` use them by
themselves), and zero-copy reads (:meth:`~ectier.daemon.client_views.ViewCalls.get_view`, a mixin
of :mod:`ectier.daemon.client_views`). Against an older daemon, :meth:`prefetch` raises,
``get_view`` copies, and ``put``/``get`` work as before.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import threading
import time
from typing import Any

from .. import errors
from ..config import DaemonConfig
from ..entry import validate_keys
from .client_copy import copy_from_device as _copy_from_device, device_to_host as _device_to_host
from .client_errors import DaemonFeatureError, DaemonUnavailableError
from .client_conn import Transport
from .client_views import ViewCalls
from .protocol import MAX_DIMS, FrameDecoder

__all__ = ["DaemonClient", "DaemonUnavailableError", "DaemonFeatureError"]

log = logging.getLogger(__name__)


class DaemonClient(Transport, ViewCalls):
    """Talk to ``ectier serve``.

    Args:
        socket_path: the daemon's socket; ``None`` = the default of :class:`~ectier.config.DaemonConfig`.
        client_name: shown in ``ectier stats`` (default ``"<program>:<pid>"``).
        timeout_s: longest wait for the reply to one request, seconds. A request not answered
            in time raises :class:`DaemonUnavailableError` and starts the back-off (below), like a
            refused connection; it is never resent on a fresh connection (a hung daemon costs one
            ``timeout_s``, not two).
        connect_retry_s: how long a call keeps retrying to connect to a daemon that went away
            (a restart); a client whose last attempt failed fails fast instead (see
            ``backoff_s``).
        backoff_s: after a failed connection attempt or an unanswered request, calls raise
            :class:`DaemonUnavailableError` at once, without trying to connect, for this many
            seconds; after that each call makes one immediate *probe* (no ``connect_retry_s``
            wait) until one succeeds. So an unreachable daemon (down, wrong ``socket_path``) or a
            hung one costs a caller at most one ``connect_retry_s`` or ``timeout_s`` wait, not one
            per call.
        probe_timeout_s: bound of a probe's connect and ``hello``, seconds (a probe is the first
            attempt after a failure, and :meth:`connect` with ``wait=False``); at most
            ``timeout_s``. A healthy daemon answers ``hello`` at once, so a probe of a hung one
            costs this much per ``backoff_s`` window, not ``timeout_s``.

    Raises (at construction): ValueError naming the argument (a time that is not a finite number
    of seconds >= 0, or not > 0 for ``timeout_s``/``probe_timeout_s``); TypeError (a
    ``socket_path`` or ``client_name`` that is not a string).

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
        probe_timeout_s: float = 1.0,
    ) -> None:
        for name, value in (("timeout_s", timeout_s), ("probe_timeout_s", probe_timeout_s),
                            ("connect_retry_s", connect_retry_s), ("backoff_s", backoff_s)):
            positive = name in ("timeout_s", "probe_timeout_s")
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not (value > 0 if positive else 0 <= value < float("inf"))):
                raise ValueError(f"DaemonClient {name}: expected a {'positive' if positive else 'finite, >= 0'} "
                                 f"number of seconds, got {value!r}")
        if socket_path is not None and not isinstance(socket_path, (str, os.PathLike)):
            raise TypeError(f"DaemonClient socket_path: expected a str path, got {type(socket_path).__name__}")
        if client_name is not None and not isinstance(client_name, str):
            raise TypeError(f"DaemonClient client_name: expected a str, got {type(client_name).__name__}")
        self.socket_path = os.fspath(socket_path) if socket_path else DaemonConfig().resolved_socket_path()
        self.client_name = client_name or f"{os.path.basename(os.sys.argv[0] or 'python')}:{os.getpid()}"
        self.timeout_s = timeout_s
        self.connect_retry_s = connect_retry_s
        self.backoff_s = backoff_s
        self.probe_timeout_s = probe_timeout_s
        # monotonic time of the last failed connection attempt or unanswered request (None: the
        # last handshake succeeded, or none was made yet); while set, calls fail fast
        self._failed_at: float | None = None
        self._failure = ""  # what failed then (the fail-fast error repeats it)
        self._sock: socket.socket | None = None
        self._decoder = FrameDecoder(1 << 30)
        self._lock = threading.RLock()
        self._connecting = False  # a background connection attempt runs (connect_in_background)
        self._next_id = 1
        self._submitted: dict[int, tuple[str, float]] = {}  # id -> (op, monotonic send time): see submit()
        self._arrived: dict[int, Any] = {}  # id of a submitted request -> its reply (or the error)
        self.server_info: dict[str, Any] = {}
        self._closed = False  # close() was called: no new connection
        self._sock_pid: int | None = None  # the process that opened the connection (_install; _drop)
        self._copies = 0  # puts/gets of this thread copying to or from the daemon's bytes now (_copying)
        self._close_deferred = False  # close() came from a signal handler during one: done after it
        self._arena_mmap: mmap.mmap | None = None
        self._arena = None  # torch uint8 tensor over the mapping, made on first data call
        self._arena_path: str | None = None
        self._arena_fd: int | None = None  # the mapped file, kept open to recognise it on reconnect
        self._arena_registered = False  # the mapping is page-locked (cudaHostRegister)
        self._ro = None  # read-only ArenaView of the views (client_views.py), per daemon run
        self._releaser = None  # this process's ViewReleaser for socket_path (client_views.py)
        self.view_refusals = 0  # get_view calls the daemon answered with a copy (view_pin_bytes)

    # --------------------------------------------------------------------------- control calls

    def ping(self) -> float:
        """Round-trip time of one ``ping``, seconds."""
        t0 = time.perf_counter()
        self.call("ping")
        return time.perf_counter() - t0

    def contains(self, key: str, *, namespace: str | None = None) -> bool:
        """True if the daemon stores ``key`` (from its memory, no I/O). Never renews any lease.

        Raises:
            InvalidKeyError: a bad key or namespace (the daemon's answer). DaemonUnavailableError:
            the daemon is unreachable, refused this client, or did not answer within ``timeout_s``.
        """
        return self.call("contains", key=key, **_ns(namespace))["found"]

    def delete(self, key: str, *, namespace: str | None = None) -> bool:
        """Remove ``key`` from every tier; True if it was stored.

        Raises:
            InvalidKeyError, DaemonUnavailableError: as :meth:`contains`.
        """
        return self.call("delete", key=key, **_ns(namespace))["deleted"]

    def stats(self) -> dict[str, Any]:
        """The daemon's stats: tiers, bytes, hits/misses/evictions, clients, leases (every key:
        docs/protocol.md, ``stats``).

        Raises:
            DaemonUnavailableError: as :meth:`contains`.
        """
        return self.call("stats")["stats"]

    def prefetch(self, keys: list[str], *, namespace: str | None = None) -> list[str]:
        """Start promoting ``keys`` into the daemon's host arena; one state per key, answered at
        once (the daemon never waits on NVMe here): ``"absent"`` (stored nowhere, or its
        promotion failed: ask again to retry), ``"promoting"`` (ask again later), ``"ready"`` (a
        :meth:`get` now pins it without I/O). One round trip for all of them.

        Raises:
            InvalidKeyError: a bad key or namespace, or ``keys`` one str (nothing sent; as
            :meth:`ectier.TieredCache.prefetch`). DaemonFeatureError: the
            daemon has no ``prefetch`` (older than this client). DaemonUnavailableError: unreachable.
        """
        keys = validate_keys(keys)
        with self._lock:
            if self._sock is None:
                self.connect()
            if "prefetch" not in self.features:
                raise DaemonFeatureError(
                    f"the ectier daemon at {self.socket_path!r} ({self.server_info.get('server', '?')}) has no "
                    "'prefetch' operation; upgrade it")
            extra = {"direct": True} if "direct" in self.features else {}
            return list(self.call("prefetch", keys=keys, **_ns(namespace), **extra)["states"])

    # ------------------------------------------------------------------------------ data calls

    def _arena_tensor(self):
        import torch

        if self._arena is None:
            arena = self.server_info["arena"]
            fd = os.open(arena["path"], os.O_RDWR)
            try:
                self._arena_mmap = mmap.mmap(fd, arena["nbytes"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                os.close(fd)
                raise
            self._arena_fd = fd
            self._arena = torch.frombuffer(self._arena_mmap, dtype=torch.uint8) if arena["nbytes"] else torch.empty(0, dtype=torch.uint8)
            self._arena_path = arena["path"]
            self._arena_registered = None  # not tried: at the first put of a CUDA tensor (_page_locked)
            from ..tensors import cuda_available
            from ..tiers.populate import populate_mapping_later

            if not cuda_available():
                self._arena_registered = False  # pageable for good
            # no fault per page in the puts (tiers/populate.py); a registration later pins pages
            # already there
            populate_mapping_later(self._arena_mmap)
        return self._arena

    def _page_locked(self, device) -> bool:
        """Whether this process's mapping of the arena is page-locked (``cudaHostRegister``), so
        that copies between the GPU and the arena are pinned DMA with no staging copy; the first
        ask registers it, under ``device`` (the device of the tensor put: never a context on
        another engine's GPU). A refusal only costs speed: logged, the mapping stays pageable
        (ectier/pinning.py)."""
        if self._arena_registered is None:
            from ..pinning import register_host

            self._arena_registered = register_host(self._arena, device=device, what="the daemon's arena")
            self._arena_device = device
        return bool(self._arena_registered)

    def _direct(self) -> dict[str, bool]:
        """``{"direct": True}`` when the daemon moves what its arena cannot take through scratch
        files (a daemon older than that would refuse the argument)."""
        if self._sock is None:
            self.connect()
        return {"direct": True} if "direct" in self.features else {}

    def _bytes_of(self, reply: dict[str, Any]):
        """A context manager over the bytes a ``reserve``/``get`` reply's ``extents`` index: the
        arena, or the scratch file at the reply's ``path`` (mapped for the duration of the copy)."""
        from .scratch import mapped

        if reply.get("path") is None:
            return contextlib.nullcontext(self._arena_tensor())
        return mapped(reply["path"], reply["nbytes"])

    def put(self, key: str, tensor, *, namespace: str | None = None, after=None) -> None:
        """Store ``tensor`` under ``key``: reserve arena space, copy into it, commit. When the arena
        has no room for it (larger than ``host.capacity_bytes``, or the rest held by other clients'
        reservations and leases) and the daemon has an NVMe tier, the bytes go through a scratch
        file and the daemon stores them on NVMe (or in the arena, if room was made meanwhile).

        A CUDA ``tensor`` is copied device → arena on a copy stream of this client, straight into
        the mapping when it is page-locked (see :meth:`_register_arena`), else through one host
        copy. ``after`` (a ``torch.cuda.Event``): that copy first waits for it, e.g. one recorded
        on the producer's stream after the kernels that wrote ``tensor`` (put from another thread
        than the producer's); ``None``: it waits for the calling thread's current stream. The
        caller keeps ``tensor`` unchanged until ``put`` returns.

        Raises:
            InvalidKeyError, InvalidTensorError, EntryTooLargeError, TierWriteError: as
            :meth:`ectier.TieredCache.put`. DaemonUnavailableError: daemon unreachable.
            LeaseExpiredError: the reservation expired before the commit, twice (the client
            stalled for longer than ``daemon.lease_s`` on both tries).
        """
        from ..tensors import byte_view, meta_for

        meta = meta_for("-", "-", tensor)  # dtype and shape; the daemon validates key/namespace
        if len(meta.shape) > MAX_DIMS:  # (the protocol's cap: docs/protocol.md)
            raise errors.InvalidTensorError(f"tensor: {len(meta.shape)} dimensions; the daemon stores at most "
                                            f"{MAX_DIMS} (in-process caches have no such cap)")
        on_device = tensor.device.type == "cuda"
        src = None  # (made once the daemon reserved room: a non-contiguous tensor is copied there)
        with self._lock:
            if on_device:  # the first CUDA put page-locks the mapping (~0.45 s per GiB) now, before
                if self._sock is None:  # it holds a reservation that could expire meanwhile
                    self.connect()
                self._arena_tensor()
                self._page_locked(tensor.device)
            with self._copying():  # (a close() from a signal handler meanwhile waits for it)
                stale = None  # (lease, daemon run) of a first attempt whose connection was lost
                for attempt in (0, 1):
                    if stale is not None:
                        self._abort_orphan(*stale)
                    reply = self.call("reserve", key=key, dtype=meta.dtype, shape=list(meta.shape), **_ns(namespace),
                                      **self._direct())
                    lease = reply["lease"]
                    run = self.server_info.get("instance")
                    try:
                        with self._bytes_of(reply) as arena:
                            if on_device and reply.get("path") is None and self._page_locked(tensor.device):
                                _copy_from_device(arena, reply["extents"], tensor, after)
                            else:
                                if src is None:
                                    src = _device_to_host(tensor, after) if on_device else byte_view(tensor)
                                off = 0
                                for start, length in reply["extents"]:
                                    arena[start : start + length].copy_(src[off : off + length])
                                    off += length
                            del arena  # before a scratch file's mapping is closed
                        self.call("commit", retry=False, lease=lease)
                        return
                    except (DaemonUnavailableError, errors.LeaseExpiredError):  # (expired: now an orphan)
                        if attempt == 1:
                            self._give_back(lease, run)
                            raise  # the daemon restarted mid-put twice, or keeps losing the connection; give up
                        stale = (lease, run)
                    except BaseException:
                        self._give_back(lease, run)
                        raise

    def _give_back(self, lease: int, run: str | None) -> None:
        """Abort ``lease`` after a put failed: on its connection if it is still there, else as an
        orphan from a new one (:meth:`_abort_orphan`). Never raises: a reservation not given back
        is the daemon's to end (its deadline, or this process's exit)."""
        try:
            if run is not None and "orphans" in self.features:
                self._abort_orphan(lease, run)
            else:
                self.call("abort", retry=False, lease=lease)
        except errors.EctierError:
            pass

    def _abort_orphan(self, lease: int, run: str | None) -> None:
        """Tell the daemon (run ``run``, when it is still the one reached) that the copy into
        ``lease``'s blocks is over: a put whose connection was lost mid-way (its lease expired
        while this client stalled, say) keeps its blocks reserved until then (docs/protocol.md,
        ``abort``). Errors are ignored: the blocks come back when this process exits."""
        try:
            if self._sock is None:
                self.connect()
            if "orphans" in self.features and run is not None and self.server_info.get("instance") == run:
                # (retry: a connection the daemon closed is replaced; the run named keeps a
                # restarted daemon from ending another lease of the same id)
                self.call("abort", lease=lease, instance=run)
        except DaemonUnavailableError:
            raise  # (the put's retry would fail the same way)
        except errors.EctierError:
            pass

    def get(self, key: str, *, namespace: str | None = None, device: str | None = None):
        """A copy of the entry under ``key`` (shape and dtype as put), or ``None`` on a miss. An
        entry the arena cannot lease (on NVMe and larger than ``host.capacity_bytes``) is read
        from NVMe through a scratch file.

        ``device``: ``None``/``"cpu"`` or an explicit ``"cuda:<index>"``.

        Raises:
            InvalidKeyError: a bad key or namespace. InvalidDeviceError: a bad ``device`` (before
            anything is sent). DaemonUnavailableError: as :meth:`contains`.
        """
        from ..tensors import parse_device

        dev = parse_device(device)
        with self._lock:
            reply = self.call("get", key=key, **_ns(namespace), **self._direct())
            tensor = self._copy_out(reply) if reply["hit"] else None
        return tensor if tensor is None or dev.type == "cpu" else tensor.to(dev)

    def _copy_out(self, reply: dict[str, Any]):
        """Copy the bytes of a ``get`` reply's lease into a new CPU tensor, then release the lease;
        ``None`` when the lease had expired meanwhile (the bytes may be foreign)."""
        import torch

        from ..tensors import torch_dtype

        out = torch.empty(reply["nbytes"], dtype=torch.uint8)
        try:
            with self._copying(), self._bytes_of(reply) as arena:
                off = 0
                for start, length in reply["extents"]:
                    out[off : off + length].copy_(arena[start : start + length])
                    off += length
                del arena  # before a scratch file's mapping is closed
        finally:
            try:
                valid = self.call("release", retry=False, lease=reply["lease"])["valid"]
            except DaemonUnavailableError:
                # the daemon closes the connection of a client whose lease expired (or went
                # away): either way the copy cannot be vouched for
                valid = False
        if not valid:
            return None
        dtype, shape = torch_dtype(reply["dtype"]), tuple(reply["shape"])
        return out.view(dtype).view(shape) if reply["nbytes"] else torch.empty(shape, dtype=dtype)

def _ns(namespace: str | None) -> dict[str, str]:
    return {} if namespace is None else {"namespace": namespace}

