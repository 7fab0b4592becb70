"""The Mooncake Store backend of the remote tier (``remote.backend: mooncake``).

A client of ``mooncake.store.MooncakeDistributedStore`` (pip ``mooncake-transfer-engine-non-cuda``
on machines without CUDA, ``mooncake-transfer-engine`` with CUDA; both need Debian's
``libibverbs1``). It talks to one ``mooncake_master`` (``remote.addresses``) and its metadata
server (``remote.mooncake_metadata_server``; the master's own HTTP one by default), and lends
``remote.mooncake_global_segment_bytes`` of this process's memory to the store (0: none).

One object ``key`` is one Mooncake object ``<remote.prefix>:<key>``, written with ``upsert`` (a
``put`` of a key that exists keeps the old value in Mooncake) and removed with ``remove(force)``
(a read's lease does not block a delete). Mooncake makes an object visible only once every byte
is written, so a reader never sees a partial one; the remote tier checks each object's header
and checksum on top.

Copies: a get asks the size (unless this backend wrote or read that object last and so knows it:
:class:`~ectier.tiers.remote.mooncake_pool.SizeHints`) and reads into registered memory
(``get_into``), skipping the copy
out of the client's own transfer buffer that plain ``get`` makes: a buffer of the pool of
registered memory (:class:`~ectier.tiers.remote.mooncake_pool.BufferPool`, at most
``remote.mooncake_buffer_pool_bytes``), handed out as the object and back in the pool when the
last view of it dies; when the pool has no room, a fresh buffer registered for the one call. A put
registers the caller's buffer and writes from it (``upsert_from``). The remote tier's writes come
as header + payload (:meth:`MooncakeBackend.put_record`): up to
:attr:`~MooncakeBackend.pooled_put_max_bytes`, copied into a pool buffer, the payload's xxh3
computed during the copy (the tier makes no pass of its own), and written with ``upsert_from``;
larger, or without room in the pool, with ``upsert_parts`` through the client's transfer buffer
(after a checksum pass, unless the caller knew it: ``checksum_known``) when the record takes at
most half of it, else joined into one buffer and put. Each measured
faster than the alternatives (docs/benchmarks.md, "Remote tier: Mooncake Store"). A buffer whose
transfer failed in a way that may leave it in flight stays registered and referenced for
:data:`~ectier.tiers.remote.mooncake_calls.HOLD_S` seconds (never freed or reused under a
transfer); past :data:`~ectier.tiers.remote.mooncake_calls.HOLD_CAP_BYTES` kept, calls fail at
once until some are released.

Deadlines: Mooncake's calls block (a hung master: 30 s each), so every call runs on a daemon
thread (the client releases the GIL in its calls) and the caller waits at most ``deadline_s``: a
late call raises :class:`RemoteTimeout` and finishes on its own thread, holding its buffers; at
most :data:`~ectier.tiers.remote.mooncake_calls.MAX_IN_FLIGHT` calls run at once (a caller waits for a slot within its deadline).

The client is set up in the background from construction on, and again after a failed setup, so a
master that is down at start is reached once it is up; until then calls fail within their
deadline. Mooncake's ``setup`` holds the GIL (0.3.13), and against a master that is down it
retries for ~90 s, which would freeze every thread of the process; so a setup starts only after
the master's RPC port accepts a connection and its HTTP metadata server answers, each within
``remote.timeout_s`` (a master that dies in between is the one case left).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

from ...errors import ConfigError, CorruptRecordError
from ...record import checksum, pack_header
from .backend import RemoteBackend, RemoteError, RemoteRefused, RemoteTimeout, byte_view
from .mooncake_calls import HOLD_S, MAX_IN_FLIGHT, Holds, Runner, check_args, import_store, route_address, time_left
from .mooncake_calls import unreachable
from .mooncake_calls import code as _code
from .mooncake_io import NO_HANDLE as _NO_HANDLE, NOT_FOUND as _NOT_FOUND, SAFE as _SAFE
from .mooncake_io import NOT_READY as _NOT_READY
from .mooncake_io import LATE as _LATE, TOO_SMALL as _TOO_SMALL, put_pooled, read_fresh, read_pooled
from .mooncake_pool import BufferPool, SizeHints, aligned_empty

__all__ = ["MooncakeBackend", "exit_now_if_abandoned"]

log = logging.getLogger(__name__)

_ABSENT = frozenset({_NOT_FOUND, _NOT_READY})  # no object (yet): a miss
_HELD: list[Any] = []  # clients closed with calls still running: never freed
_GET_ATTEMPTS = 3


class MooncakeBackend(RemoteBackend):
    """Objects on a Mooncake Store (``remote.backend: mooncake``).

    Args:
        cfg: a :class:`~ectier.config.RemoteTierConfig`: ``addresses`` (the master, ``host:port``),
            ``prefix``, ``timeout_s`` (the deadline of the background setup's first wait), and the
            ``mooncake_*`` fields (metadata server, local hostname, segment and buffer sizes in
            bytes, protocol ``tcp`` / ``rdma``, RDMA device names).
        store_factory: makes the client (default ``mooncake.store.MooncakeDistributedStore``).

    The client's setup starts in the background here; calls made before it ends wait for it within
    their deadline.

    Raises:
        ConfigError: the ``mooncake`` package is not importable (``pip install 'ectier[mooncake]'``
            and ``apt-get install libibverbs1``), or ``remote.addresses`` is not one ``host:port``.
    """

    name = "mooncake"
    computes_checksum = True
    #: put / get through registered memory (``upsert_from`` / ``get_into``); False: plain
    #: ``upsert`` / ``get`` (slower; kept for the measurement in benchmarks/remote_mooncake_bench.py)
    zero_copy = True
    #: objects whose size a get knows without ``get_size`` (the last this backend wrote or read);
    #: 0: always ask (kept for the measurement in benchmarks/remote_mooncake_bench.py)
    size_hints = 4096
    #: records up to this many bytes are written from the pool, the checksum computed while they
    #: are copied in; larger ones (up to half the client's buffer) with ``upsert_parts`` after a
    #: checksum pass — measured cheaper at 64 MiB, dearer at 16 MiB (docs/benchmarks.md)
    pooled_put_max_bytes = 32 << 20

    def __init__(self, cfg: Any, store_factory: Callable[[], Any] | None = None) -> None:
        if store_factory is None:
            store_factory = import_store()
        addrs = cfg.address_list
        if len(addrs) != 1:
            raise ConfigError(f"remote.addresses: one master 'host:port' for mooncake, got {cfg.addresses!r}")
        self._cfg = cfg
        self._factory = store_factory
        self._master = f"{addrs[0][0]}:{addrs[0][1]}"
        self._metadata = cfg.mooncake_metadata_server or f"http://{addrs[0][0]}:8080/metadata"
        self._hostname = cfg.mooncake_local_hostname or route_address(*addrs[0])
        self._prefix = cfg.prefix
        self._lock = threading.Lock()
        self._store: Any = None
        self._setup_done: threading.Event | None = None
        self._setup_error = ""
        self._closed = False
        self._in_use = 0  # calls holding the client (late ones included)
        self._idle = threading.Condition(self._lock)
        self._runner = Runner(MAX_IN_FLIGHT)
        self._holds = Holds()
        pool_bytes = int(cfg.mooncake_buffer_pool_bytes)
        self._pool = BufferPool(pool_bytes) if pool_bytes > 0 and self.zero_copy else None
        self._sizes = SizeHints(self.size_hints)
        self._start_setup()

    # ------------------------------------------------------------------ connection

    def _start_setup(self) -> threading.Event:
        """Start a setup on its own thread unless one runs (call with or without the lock held
        by nobody else: it takes it)."""
        with self._lock:
            if self._setup_done is None:
                self._setup_done = threading.Event()
                threading.Thread(target=self._setup, args=(self._setup_done,), name="ectier-mooncake-setup",
                                 daemon=True).start()
            return self._setup_done

    def _setup(self, done: threading.Event) -> None:
        cfg = self._cfg
        store, error = None, self._unreachable()
        if not error:
            try:
                store = self._factory()
                rc = store.setup(self._hostname, self._metadata, int(cfg.mooncake_global_segment_bytes),
                                 int(cfg.mooncake_local_buffer_bytes), cfg.mooncake_protocol,
                                 cfg.mooncake_device_name, self._master)
                if rc != 0:
                    error = f"setup with master {self._master} and metadata {self._metadata} failed: {_code(rc)}"
            except Exception as exc:  # noqa: BLE001 - reported to the callers as RemoteError
                error = f"setup with master {self._master} failed: {type(exc).__name__}: {exc}"
        if error:
            log.debug("mooncake: %s", error)
            _close_quietly(store)
            store = None
        with self._lock:
            if self._closed:
                _close_quietly(store)
                store = None
            self._store, self._setup_error = store, error
            if store is None:
                self._setup_done = None  # the next call starts another setup
        done.set()

    def _unreachable(self) -> str:
        return unreachable(self._master, self._metadata, self._cfg.timeout_s)

    def _client(self, what: str, end: float, seconds: float) -> Any:
        """The client, counted in use (:meth:`_release` when the call ended)."""
        with self._lock:
            if self._closed:
                raise RemoteError("mooncake: the backend is closed")
            if self._store is not None:
                self._in_use += 1
                return self._store
        done = self._start_setup()
        if not done.wait(max(0.0, end - time.monotonic())):
            raise RemoteTimeout(f"mooncake {what}: master {self._master} not reached within the deadline of "
                                f"{seconds:g} s (setup goes on in the background)")
        with self._lock:
            if self._closed:
                raise RemoteError("mooncake: the backend is closed")
            if self._store is not None:
                self._in_use += 1
                return self._store
            raise RemoteError(f"mooncake {what}: {self._setup_error or 'not connected'}")

    def _release(self) -> None:
        with self._lock:
            self._in_use -= 1
            self._idle.notify_all()

    def _call(self, what: str, deadline_s: float, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)`` on a call thread, within ``deadline_s`` (setup wait included)."""
        end = time.monotonic() + deadline_s
        if self._holds.full():
            raise RemoteError(f"mooncake {what}: {self._holds.nbytes} bytes of failed transfers are kept for up to "
                              f"{HOLD_S:g} s (they may still be in flight); no new transfer until then")
        store = self._client(what, end, deadline_s)

        def call() -> Any:
            self._holds.release_expired(store)
            return fn(store)

        try:
            return self._runner.run(what, call, end, deadline_s, self._release)
        except (RemoteError, CorruptRecordError):  # the latter: one object's fault, not the store's
            raise
        except Exception as exc:  # the client's own (a binding that raises): a failed call, not a crash
            raise RemoteError(f"mooncake {what} on {self._master}: {type(exc).__name__}: {exc}") from exc

    def _object(self, key: str) -> str:
        return f"{self._prefix}:{key}"

    # ------------------------------------------------------------------ the interface

    def put(self, key: str, data: bytes | memoryview, *, deadline_s: float) -> None:
        """Store ``data`` (bytes-like, C-contiguous, at least 1 byte: Mooncake holds no empty
        object) under ``key``, replacing what was there.

        Raises:
            ValueError / TypeError: a bad key, data or deadline_s.
            RemoteRefused: the store has no room for it (``NO_AVAILABLE_HANDLE``: larger than any
                segment's free space, ``INVALID_PARAMS``): the store is up, the tier backs nothing off.
            RemoteError, RemoteTimeout: the store failed or the deadline passed.
        """
        check_args(key, deadline_s)
        view = byte_view(data)
        if not len(view):
            raise ValueError("data: Mooncake Store holds no empty object (the remote tier's records never are)")
        name = self._object(key)

        def write(store: Any) -> int:
            if not self.zero_copy:
                return store.upsert(name, view)
            arr = np.frombuffer(view, dtype=np.uint8)
            ptr = arr.ctypes.data
            if store.register_buffer(ptr, arr.size) != 0:
                return store.upsert(name, view)  # the copy through the client's own buffer
            rc = store.upsert_from(name, ptr, arr.size)
            if rc < 0 and rc not in _SAFE:
                self._holds.hold(rc, ptr, arr.size, (view, data))
            else:
                store.unregister_buffer(ptr)
            return rc

        rc = self._call("put", deadline_s, write)
        if rc != 0:
            cls = RemoteRefused if rc in (_NO_HANDLE, _TOO_SMALL) else RemoteError  # no room: the store is up
            raise cls(f"mooncake put of {len(view)} bytes on {self._master}: {_code(rc)}")
        self._sizes.note(name, len(view))

    def put_record(self, key: str, header: Any, payload: Any, *, deadline_s: float,
                   checksum_known: bool = False) -> None:
        """Store one record (``header``, then ``payload``) under ``key``; ``header.payload_checksum``
        is stored as the payload's xxh3-64, computed here (``computes_checksum``) unless
        ``checksum_known`` (the caller knew it: stored as given, no pass over the payload for it).
        A record up to :attr:`pooled_put_max_bytes` (or one larger than half of
        ``remote.mooncake_local_buffer_bytes``) is copied into a buffer of the pool of registered
        memory, the checksum computed during that copy, and written with ``upsert_from``; otherwise,
        or without room in the pool, a record up to half of that buffer goes through the client's
        own buffer with ``upsert_parts`` (the checksum computed first), a larger one (or one that
        finds that buffer full) is copied into one new buffer and written from it as :meth:`put`
        does. Each measured faster than the alternatives in docs/benchmarks.md. A call past its
        deadline may still read ``payload`` on its thread: a copy into the pool that ends past the
        deadline writes nothing (its checksum, computed over what was copied, would vouch for bytes
        the caller may have reused); on the other paths the checksum comes first (or was known), so
        such an object fails it (a miss).

        Raises:
            ValueError / TypeError: a bad key, payload or deadline_s.
            RemoteRefused: no room for it on any path (as :meth:`put`).
            RemoteError, RemoteTimeout.
        """
        check_args(key, deadline_s)
        end = time.monotonic() + deadline_s  # the pool's copy too: the caller waits for it
        body = byte_view(payload)
        if len(body) != header.payload_nbytes:
            raise ValueError(f"payload: {len(body)} bytes, header.payload_nbytes is {header.payload_nbytes}")
        name = self._object(key)
        nbytes = len(pack_header(header)) + len(body)  # the checksum's value does not change the length
        parts = self.zero_copy and nbytes <= self._cfg.mooncake_local_buffer_bytes // 2
        if self._pool is not None and (nbytes <= self.pooled_put_max_bytes or not parts):
            rc = self._call("put", deadline_s, lambda store: put_pooled(store, self._pool, self._holds, name, header,
                                                                        body, end, hashing=not checksum_known))
            if rc == _LATE:
                raise RemoteTimeout(f"mooncake put: the copy of {nbytes} bytes ended past the deadline")
            if self._put_done(rc, name, nbytes):
                return
            deadline_s = time_left(end, "no room in the buffer pool")
        if not checksum_known:
            header = dataclasses.replace(header, payload_checksum=checksum(body))
        head = pack_header(header)
        if parts:
            if self._put_done(self._call("put", deadline_s, lambda store: store.upsert_parts(name, head, body)),
                              name, nbytes):
                return
            deadline_s = time_left(end, "the client's buffer was full")
        buf = aligned_empty(nbytes)
        buf[:len(head)] = np.frombuffer(head, dtype=np.uint8)
        if len(body):
            buf[len(head):] = np.frombuffer(body, dtype=np.uint8)
        self.put(key, memoryview(buf), deadline_s=deadline_s)

    def _put_done(self, rc: int | None, name: str, nbytes: int) -> bool:
        """True: a put's ``rc`` says the object is stored; False: no room (the next path may have
        some: ``None`` from the pool, or Mooncake's no-handle / too-small). Raises RemoteError."""
        if rc == 0:
            self._sizes.note(name, nbytes)
            return True
        if rc is not None and rc not in (_TOO_SMALL, _NO_HANDLE):
            raise RemoteError(f"mooncake put of {nbytes} bytes on {self._master}: {_code(rc)}")
        return False

    def get(self, key: str, *, deadline_s: float) -> memoryview | bytes | None:
        """The object under ``key`` (a memoryview of a new buffer), or ``None`` if there is none
        (or its put, by any client, has not completed yet: Mooncake's REPLICA_IS_NOT_READY).

        Raises:
            ValueError: a bad key or deadline_s.
            RemoteError, RemoteTimeout.
        """
        check_args(key, deadline_s)
        name = self._object(key)
        return self._call("get", deadline_s, lambda store: self._read(store, name))

    def _read(self, store: Any, name: str) -> memoryview | bytes | None:
        if not self.zero_copy:
            size = self._checked_size(store.get_size(name), name)
            return (store.get(name) or None) if size > 0 else self._answer(size, name, None)
        hint = self._sizes.get(name) if self._pool is not None else None
        pooled = self._pool.acquire(store, hint) if hint else None
        if pooled is not None:  # the size this backend last wrote or read: no get_size
            rc, got = read_pooled(store, self._pool, self._holds, name, pooled, pooled.capacity)
            if rc != _TOO_SMALL:
                return self._answer(rc, name, got)
        for _ in range(_GET_ATTEMPTS):  # an overwrite between get_size and get_into: again
            size = self._checked_size(store.get_size(name), name)
            if size <= 0:
                return self._answer(size, name, None)
            pooled = self._pool.acquire(store, size) if self._pool is not None else None
            rc, got = (read_pooled(store, self._pool, self._holds, name, pooled, size) if pooled
                       else read_fresh(store, self._holds, name, size))
            if rc != _TOO_SMALL:
                return self._answer(rc, name, got)
        return None  # overwritten under every attempt: a miss

    def _checked_size(self, size: int, name: str) -> int:
        """``size`` (``get_size``'s answer: bytes, or a code <= 0), unless it is more than
        ``remote.max_entry_bytes``: no object of ours is, so a foreign one is refused before a
        buffer is allocated for it (CorruptRecordError: a counted checksum failure, a miss)."""
        if size > self._cfg.max_entry_bytes:
            raise CorruptRecordError(f"mooncake object {name!r} holds {size} bytes, more than "
                                     f"remote.max_entry_bytes={self._cfg.max_entry_bytes}")
        return size

    def _answer(self, rc: int, name: str, got: Any) -> Any:
        """A read's answer after Mooncake's ``rc`` (a size, or a code): ``got`` (``rc`` > 0 bytes),
        or ``None`` for no object (yet). Raises RemoteError for any other code."""
        if rc > 0:
            self._sizes.note(name, rc)
            return got
        if rc in _ABSENT or rc == 0:
            self._sizes.drop(name)
            return None
        raise RemoteError(f"mooncake get on {self._master}: {_code(rc)}")

    def exists(self, key: str, *, deadline_s: float) -> bool:
        """Whether an object is stored under ``key``.

        Raises:
            ValueError: a bad key or deadline_s.
            RemoteError, RemoteTimeout.
        """
        check_args(key, deadline_s)
        name = self._object(key)
        rc = self._call("exists", deadline_s, lambda store: store.is_exist(name))
        if rc in _ABSENT:
            return False
        if rc < 0:
            raise RemoteError(f"mooncake exists on {self._master}: {_code(rc)}")
        return rc == 1

    def delete(self, key: str, *, deadline_s: float) -> None:
        """Remove the object under ``key`` (even while a reader holds its lease). No error if absent.

        Raises:
            ValueError: a bad key or deadline_s.
            RemoteError, RemoteTimeout.
        """
        check_args(key, deadline_s)
        name = self._object(key)
        self._sizes.drop(name)
        rc = self._call("delete", deadline_s, lambda store: store.remove(name, True))
        if rc not in (0, _NOT_FOUND):
            raise RemoteError(f"mooncake delete on {self._master}: {_code(rc)}")

    def describe(self) -> dict[str, Any]:
        """``backend``, ``addresses`` (the master), ``metadata_server``, ``local_hostname``,
        ``protocol``, ``connected``, ``global_segment_bytes``, ``late_calls`` (calls past their
        deadline still running), ``held_bytes`` (buffers of failed transfers kept), ``prefix``,
        ``buffer_pool`` (the pool of registered memory: ``limit_bytes``, ``held_bytes``,
        ``out_bytes`` handed out or in use, ``registrations``, ``reuses``, ``refusals``; ``None``
        when ``remote.mooncake_buffer_pool_bytes`` is 0)."""
        cfg = self._cfg
        with self._lock:
            connected = self._store is not None
        return {"backend": self.name, "addresses": self._master, "metadata_server": self._metadata,
                "local_hostname": self._hostname, "protocol": cfg.mooncake_protocol, "connected": connected,
                "global_segment_bytes": int(cfg.mooncake_global_segment_bytes), "late_calls": self._runner.late,
                "held_bytes": self._holds.nbytes, "prefix": self._prefix,
                "buffer_pool": self._pool.describe() if self._pool is not None else None}

    def close(self) -> None:
        """Close the client (unmounts this process's segment: the objects on it are gone), after
        the calls still running ended, waiting at most ``remote.timeout_s`` for them; a client
        with calls still running past that is left open (closing it under a call would crash the
        process). Idempotent; calls after it raise RemoteError.

        Bounded by about 3 x ``remote.timeout_s``: Mooncake's own teardown holds the GIL and, with
        a master that does not answer, takes its HTTP and RPC timeouts (~10-16 s) — so it runs only
        after the master's RPC port and metadata server answered, each within ``remote.timeout_s``;
        else the client is abandoned, left open and referenced, with one warning (Mooncake's
        exit handler still tears it down when the process exits). Buffers of the pool handed out
        stay valid: their memory is freed with their last view."""
        with self._lock:
            self._closed = True
            idle = self._idle.wait_for(lambda: self._in_use == 0, self._cfg.timeout_s)
            store, self._store = self._store, None
        if store is None:
            if self._pool is not None:
                self._pool.close(None)
            return
        if not idle:
            _HELD.append((store, self._pool))  # the pool's buffers stay registered with it
            log.debug("mooncake: closed with calls still running; the client stays open for them")
            return
        why = self._unreachable()
        if why:
            _HELD.append((store, self._pool))
            log.warning("mooncake: close: %s; the client is left open (Mooncake's teardown would block the "
                        "process for its own timeouts)", why)
            return
        t = threading.Thread(target=_close_quietly, args=(store, self._pool), name="ectier-mooncake-close",
                             daemon=True)
        t.start()
        t.join(self._cfg.timeout_s)


def exit_now_if_abandoned(code: int) -> None:
    """End the process at once with exit status ``code`` (``os._exit``, after flushing logging,
    stdout and stderr) if :meth:`MooncakeBackend.close` left a client open (a master that did not
    answer, or calls still running); return if it did not. For a process's last step (``ectier
    serve``): Mooncake's exit handler would otherwise tear that client down against the master
    that does not answer, holding the exit for its own timeouts (~10-16 s)."""
    if not _HELD:
        return
    log.warning("mooncake: exiting without Mooncake's teardown of %d client(s) left open", len(_HELD))
    logging.shutdown()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


def _close_quietly(store: Any, pool: BufferPool | None = None) -> None:
    if store is None:
        return
    try:
        if pool is not None:
            pool.close(store)  # its free buffers unregistered first
        store.close()
    except Exception as exc:  # noqa: BLE001
        log.debug("mooncake: close: %s", exc)
