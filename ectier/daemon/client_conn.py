"""The daemon client's connection: connect and handshake, back-off, one request's round trip, and
(its base :class:`~ectier.daemon.client_submit.Submissions`) requests sent without waiting for their
reply (:meth:`Transport.submit` / :meth:`Transport.poll`).

:class:`Transport` is the base of :class:`~ectier.daemon.client.DaemonClient` (which documents the
arguments and the reconnect rules); it owns the socket, the frame decoder, the lock that
serialises calls, the back-off state, the ``hello`` reply (``server_info``) and the arena mapping's
lifetime (dropped when the daemon behind the socket changes).

Asynchronous requests: :meth:`Transport.submit` sends a request and returns its id at once;
:meth:`Transport.poll` returns its reply once it has arrived (reading only what the socket already
holds, or waiting at most the ``timeout`` it is given). Synchronous calls made meanwhile on the
same connection keep the replies of submitted requests they read for :meth:`poll`. A submitted
request unanswered after ``timeout_s`` counts as a hung daemon (the connection is dropped and the
back-off starts); one whose connection was lost is answered by ``DaemonUnavailableError``.
Both read and write the socket's descriptor directly (it is non-blocking, the socket having a
timeout): a request is one ``write``, reading what has arrived one ``read``, no poll first.

Connecting without waiting: :meth:`Transport.connect_in_background` starts one attempt in a
thread of its own (no lock held while it connects and handshakes) and returns at once — what a
vLLM scheduler step does, so a daemon that is down or stopped never blocks it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import stat
import threading
import time
from typing import Any, Iterator

from .. import errors
from ..entry import validate_key, validate_namespace
from .client_errors import DaemonUnavailableError, reply_results as _results
from .client_submit import Submissions
from .protocol import DEFAULT_MAX_FRAME_BYTES, PROTOCOL_VERSION, FrameDecoder, ProtocolError, encode_frame

__all__ = ["Transport"]

log = logging.getLogger(__name__)


class Transport(Submissions):
    """Connection state and requests of a daemon client (module docstring). Expects the
    attributes :class:`~ectier.daemon.client.DaemonClient` sets up in ``__init__``."""

    def connect(self, *, wait: bool = True) -> None:
        """Connect and handshake now (calls do this lazily). A connection lost during the
        handshake (a daemon restarting) is retried once on a new one, as :meth:`call` does.
        ``wait=False``: a probe, as at start-up: one attempt, no ``connect_retry_s`` wait, bounded
        by ``probe_timeout_s``; a failure starts the back-off window like any other.

        Raises:
            DaemonUnavailableError: unreachable, no ``hello`` reply in time, or the connection
            lost during the handshake (twice unless a probe). The daemon's typed error: a refusal."""
        with self._lock:
            for attempt in (0, 1) if wait else (1,):
                if self._sock is not None:
                    return
                try:
                    self._connect(wait=wait)
                except OSError as exc:  # ConnectionResetError, BrokenPipeError, ...: lost in the handshake
                    self._drop()
                    if attempt == 1:
                        raise DaemonUnavailableError(
                            f"lost the ectier daemon at {self.socket_path!r} during the handshake: {exc}") from None

    @property
    def unreachable(self) -> bool:
        """True while the last connection attempt or request failed (calls then fail fast)."""
        return self._failed_at is not None

    @property
    def connecting(self) -> bool:
        """True while a background connection attempt runs (:meth:`connect_in_background`)."""
        return self._connecting

    def _fail(self, message: str) -> DaemonUnavailableError:
        """Start the back-off window: calls fail fast with ``message`` for ``backoff_s``."""
        self._failed_at = time.monotonic()
        self._failure = message
        return DaemonUnavailableError(message)

    def _connect(self, *, wait: bool = True) -> None:
        if self._closed:
            raise DaemonUnavailableError("this DaemonClient is closed (close() was called); make a new one")
        now = time.monotonic()
        probe = not wait
        if self._failed_at is not None:
            if now - self._failed_at < self.backoff_s:
                raise DaemonUnavailableError(
                    f"{self._failure} ({now - self._failed_at:.2f} s ago; next attempt after {self.backoff_s:g} s)"
                )
            probe = True  # known down: one short attempt per back-off window, never a retry wait
        try:
            opened = self._open(probe)
        except DaemonUnavailableError:
            # the daemon whose arena we map is gone: let go of its (unlinked) file now, or its
            # pages stay allocated in daemon.shm_dir and a restarted daemon may find no room for
            # its own arena
            self._unmap()
            raise
        self._install(*opened)

    def _open(self, probe: bool) -> tuple[socket.socket, FrameDecoder, dict[str, Any]]:
        """Connect and handshake a new socket, touching no state of the connection but the
        back-off (a failure starts it): ``(socket, decoder, hello reply)``. ``probe``: one attempt
        bounded by ``probe_timeout_s``; else retried for ``connect_retry_s``. Raises
        DaemonUnavailableError (unreachable, or no ``hello`` in time), the daemon's typed error
        (a refusal), OSError (lost during the handshake)."""
        timeout = min(self.timeout_s, self.probe_timeout_s) if probe else self.timeout_s
        deadline = time.monotonic() + (0.0 if probe else self.connect_retry_s)
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(timeout)  # from here on the descriptor is non-blocking (see _send_nowait)
            try:
                sock.connect(self.socket_path)
                break
            except OSError as exc:
                sock.close()
                not_socket = _not_a_socket(self.socket_path)  # (a plain file or a directory: "Connection refused")
                # a path that is no socket, or one too long for AF_UNIX (no errno), cannot come right by waiting
                if time.monotonic() >= deadline or not_socket or exc.errno is None:
                    reason = "it is not a socket" if not_socket else (exc.strerror or str(exc))
                    raise self._fail(
                        f"cannot reach the ectier daemon at {self.socket_path!r}: {reason}; "
                        "is `ectier serve` running (daemon.socket_path)?"
                    ) from None
                time.sleep(0.05)
        decoder = FrameDecoder(1 << 30)
        try:
            sock.sendall(encode_frame({"id": 0, "op": "hello", "version": PROTOCOL_VERSION, "client": self.client_name}))
            end = time.monotonic() + timeout
            while True:
                sock.settimeout(max(end - time.monotonic(), 1e-3))
                data = sock.recv(65536)
                if not data:
                    raise ConnectionResetError("daemon closed the connection")
                try:
                    msgs = list(decoder.feed(data))
                except ProtocolError as exc:  # (e.g. "frame of 1213486160 bytes exceeds the cap": HTTP)
                    msgs = [exc]
                for msg in msgs:
                    if isinstance(msg, ProtocolError):  # the framing, not the daemon's error reply
                        sock.close()
                        raise self._fail(
                            f"the socket at {self.socket_path!r} did not answer 'hello' as an ectier daemon does "
                            f"({msg}); is daemon.socket_path another program's socket?") from None
                    return sock, decoder, _results(msg)
        except socket.timeout:
            sock.close()
            raise self._fail(
                f"the ectier daemon at {self.socket_path!r} did not answer 'hello' within {timeout:g} s "
                "(hung, stopped or overloaded?)") from None
        except BaseException:
            sock.close()
            raise

    def _install(self, sock: socket.socket, decoder: FrameDecoder, info: dict[str, Any]) -> None:
        """Make an opened socket the connection (under the lock)."""
        self._sock, self._decoder = sock, decoder
        self._sock_pid = os.getpid()  # (a forked child shares the socket: it says no ``bye`` on it)
        self._failed_at = None
        self.server_info = info
        # map the arena afresh unless it is the very file already mapped: a restarted daemon may
        # create its arena under the old name (same pid, e.g. PID 1 of a container), and the old
        # mapping would then be an unlinked file the daemon no longer reads
        if not self._maps_arena_of(info):
            self._unmap()

    def connect_in_background(self) -> bool:
        """True if connected now. Else starts one connection attempt (a probe, bounded by
        ``probe_timeout_s``) in a background thread — none while one runs or during the back-off
        window — and returns False at once: the caller never waits on a daemon that is down,
        hung or stopped (a scheduler step). Never raises."""
        with self._lock:
            if self._closed:
                return False
            if self._sock is not None:
                if self._read_arrived():
                    return True
                self._drop()  # the daemon closed it (idle timeout, restart): a new one, in the background
                if not self._listening():
                    self._fail(f"the ectier daemon at {self.socket_path!r} closed the connection and nothing "
                               "listens there now")
                    return False  # gone for good: a miss at once, the back-off starts
            if self._connecting or (self._failed_at is not None
                                    and time.monotonic() - self._failed_at < self.backoff_s):
                return False
            self._connecting = True
        threading.Thread(target=self._connect_quietly, name="ectier-daemon-connect", daemon=True).start()
        return False

    def _listening(self) -> bool:
        """False if nothing listens at the socket path (refused or absent: known at once, no
        wait); True otherwise (a listener, perhaps hung: the handshake goes to the background)."""
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.setblocking(False)
        try:
            probe.connect(self.socket_path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True  # e.g. a full backlog: not known to be gone
        finally:
            probe.close()
        return True

    def _connect_quietly(self) -> None:
        try:
            opened = self._open(probe=True)  # no lock held: calls meanwhile fail fast
            with self._lock:
                if self._sock is None:
                    self._install(*opened)
                else:
                    opened[0].close()
        except Exception as exc:  # noqa: BLE001 - the back-off started; calls report it
            log.debug("connecting to the ectier daemon in the background failed: %s", exc)
            if not isinstance(exc, DaemonUnavailableError):
                self._fail(f"connecting to the ectier daemon at {self.socket_path!r} failed: {exc}")
            with self._lock:
                if self._sock is None:
                    self._unmap()
                else:
                    self._failed_at = None  # another call connected meanwhile: no back-off
        finally:
            self._connecting = False

    def _maps_arena_of(self, info: dict[str, Any]) -> bool:
        """True if the current mapping is of the arena ``info`` names (same live file, same size)."""
        if self._arena_fd is None:
            return False
        try:
            arena = info["arena"]
            mine, theirs = os.fstat(self._arena_fd), os.stat(arena["path"])
        except (OSError, KeyError, TypeError):
            return False
        return (mine.st_nlink > 0 and (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)
                and arena.get("path") == self._arena_path and self._arena_mmap is not None
                and arena.get("nbytes") == len(self._arena_mmap))

    def _peer_closed(self) -> bool:
        """True if the daemon closed this connection (idle timeout, room for another client,
        restart): an end of file is waiting on the socket. Costs one poll, no wait."""
        assert self._sock is not None
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
            if not readable:
                return False
            return not self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except (OSError, ValueError):
            return True

    def _drop(self) -> None:
        """Close the connection. A daemon that offers ``bye`` is told first (one non-blocking
        write; a hung or gone daemon just misses it) that no copy into this connection's
        reservations is in flight or will come: it ends them at the close instead of keeping
        them as orphans (a reply this client never read may have granted one). True here: a
        put's copy runs under this client's lock, as every caller of this method does; not in a
        forked child, which shares the socket but not the parent's copies (it says nothing)."""
        if self._sock is not None:
            if "bye" in self.features and self._sock_pid == os.getpid():
                try:
                    self._sock.setblocking(False)  # (never waits; closed next) and no SIGPIPE if it is gone
                    self._sock.send(encode_frame({"id": self._next_id, "op": "bye"}), socket.MSG_NOSIGNAL)
                    self._next_id += 1
                except OSError:
                    pass
            try:
                self._sock.close()
            except OSError:
                pass
            self._lose_submitted("the connection was dropped")
        self._sock = None

    def _unmap(self) -> None:
        if getattr(self, "_arena_registered", False) and self._arena is not None:
            from ..pinning import unregister_host

            unregister_host(self._arena, device=getattr(self, "_arena_device", None))
            self._arena_registered = False
        self._arena = None
        if self._arena_mmap is not None:
            try:
                self._arena_mmap.close()
            except BufferError:
                pass  # a tensor view still exists; the mapping goes with it
            self._arena_mmap = None
        if self._arena_fd is not None:
            os.close(self._arena_fd)
            self._arena_fd = None
        self._arena_path = None

    def close(self) -> None:
        """Close the connection (leases held by this client are released by the daemon); later
        calls raise DaemonUnavailableError (they reconnected silently before). The daemon is told
        (``bye``) that no copy into this connection's put reservations runs any more, so they end
        rather than stay reserved as orphans: a caller of the low-level ``call("reserve")`` must
        not close while another of its threads still copies into the extents. Called from a
        signal handler while this thread is in the middle of a put or get, it takes effect when
        that call is done."""
        with self._lock:
            self._closed = True
            if self._copies:  # re-entered from a signal handler while this thread copies: after it
                self._close_deferred = True
                return
            self._drop()
            self._unmap()

    @contextlib.contextmanager
    def _copying(self) -> Iterator[None]:
        """Around a put or get from its reservation or lease to the end of its copy (under the
        lock): a :meth:`close` that a signal handler makes meanwhile, in this thread, waits for
        the end of it. Closing at once would unmap the arena under the copy (a crash) and say
        ``bye`` while the copy still writes (the daemon would free its blocks for other entries)."""
        self._copies += 1
        try:
            yield
        finally:
            self._copies -= 1
            if not self._copies and self._close_deferred:
                self._close_deferred = False
                self.close()

    def __enter__(self) -> "Transport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _roundtrip(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send ``request`` and wait at most ``timeout`` seconds in all for its reply. No reply in
        time: the connection is dropped and the back-off starts (DaemonUnavailableError)."""
        assert self._sock is not None
        rid = self._next_id
        self._next_id += 1
        try:
            frame = encode_frame({"id": rid, **request}, max_frame_bytes=self.max_frame_bytes)
        except UnicodeEncodeError as exc:  # a lone surrogate: the cache refuses such keys too
            raise errors.InvalidKeyError(f"{request.get('op')}: strings must be valid UTF-8: {exc}") from None
        deadline = time.monotonic() + timeout
        reply = None
        try:
            self._sock.settimeout(timeout)
            self._sock.sendall(frame)
            while reply is None:
                self._sock.settimeout(max(deadline - time.monotonic(), 1e-3))
                data = self._sock.recv(65536)
                if not data:
                    raise ConnectionResetError("daemon closed the connection")
                for msg in self._decoder.feed(data):
                    if isinstance(msg, ProtocolError):
                        raise msg
                    if msg.get("id") not in (rid, None):
                        self._keep_reply(msg)  # a submitted request's (poll takes it), else stale
                        continue
                    reply = msg
                    break
        except socket.timeout:
            self._drop()
            raise self._fail(
                f"the ectier daemon at {self.socket_path!r} did not answer {request.get('op')!r} within "
                f"{timeout:g} s (hung, stopped or overloaded?)"
            ) from None
        except BaseException:  # a signal's exception, lost framing, ...: the reply would reach nobody
            self._drop()  # (and a reservation it granted ends at the close: see _drop)
            raise
        return _results(reply)

    def call(self, op: str, *, retry: bool = True, **args: Any) -> dict[str, Any]:
        """Send one request and return its results. Raises the daemon's typed error on an error
        reply, DaemonUnavailableError when the daemon is unreachable or does not answer within
        ``timeout_s`` (never retried), or went away twice.

        ``retry=True``: a connection the daemon closed (restart, idle timeout) is replaced first,
        and a request whose connection is lost is sent again once on a new one. ``retry=False``
        (requests bound to this connection: ``commit``, ``release`` of its leases): neither."""
        if "key" in args:
            validate_key(args["key"])
        if "namespace" in args:
            validate_namespace(args["namespace"])
        with self._lock:
            for attempt in (0, 1):
                try:
                    if self._sock is not None and retry and self._peer_closed():
                        self._drop()
                    if self._sock is None:
                        self._connect()
                    return self._roundtrip({"op": op, **args}, self.timeout_s)
                except DaemonUnavailableError:
                    self._drop()
                    raise
                except OSError as exc:  # ConnectionError, BrokenPipeError, ...: the daemon went away
                    self._drop()
                    if attempt == 1 or not retry:
                        raise DaemonUnavailableError(f"lost the ectier daemon at {self.socket_path!r}: {exc}") from None
            raise AssertionError("unreachable")


    @property
    def features(self) -> frozenset[str]:
        """What the daemon of the current connection offers (``hello``'s ``features``; empty
        before the first connection and for a daemon older than them)."""
        return frozenset(self.server_info.get("features") or ())

    @property
    def max_frame_bytes(self) -> int:
        """The daemon's cap of one request frame in bytes (``hello``'s ``max_frame_bytes``:
        ``daemon.max_frame_bytes``; the protocol's default before a connection and for an older
        daemon)."""
        return self.server_info.get("max_frame_bytes") or DEFAULT_MAX_FRAME_BYTES


def _not_a_socket(path: str) -> bool:
    """True if ``path`` exists and is something other than a socket."""
    try:
        return not stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False
