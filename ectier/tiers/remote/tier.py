"""The remote tier: self-describing, checksummed records on a distributed store, behind a deadline.

Every object is one record in the NVMe tier's format (``ectier/tiers/nvme_record.py``: header
with namespace, key, dtype, shape, version, xxh3 of the payload; then the payload), under the
hex digest of its namespace and key (the backend adds ``remote.prefix``: ``<prefix>:m:<digest>``
for Redis). A read checks the header, the identity
(namespace and key), the length and the checksum: any mismatch is a miss, counted
(``checksum_failures``) — never a wrong tensor.

The tier knows nothing of what is local: it is asked only by the mover (write-through after a
put; a fetch after a local miss). It answers the Tier protocol's questions without I/O — it
``holds`` nothing that a local lookup could use, and reports no occupancy (the store keeps its own
budget). A failed or timed-out call puts it in back-off for ``remote.backoff_s``: calls are then
skipped (counted ``skipped_degraded``) so the serving engine never waits on a store that is down;
the next call after the back-off tries again. A failure of one node of a clustered store
(:class:`~ectier.tiers.remote.backend.RemoteNodeError`) is counted but starts no back-off: the
backend fails the calls needing that node at once (``skipped_node_down``), the other nodes serve.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

import torch

from ...codec import RawCodec
from ...config import RemoteTierConfig
from ...entry import EntryMeta
from ...errors import CorruptRecordError, UnknownCodecError
from ...record import header_nbytes
from ...stats import LatencyHistogram
from ..base import Tier
from ..nvme_index import HEADER_ALLOWANCE_BYTES
from ..nvme_record import encode_record, verify_record
from .backend import RemoteBackend, RemoteError, RemoteNodeError, RemoteRefused, RemoteTimeout

__all__ = ["RemoteTier", "REMOTE_COUNTERS"]

log = logging.getLogger(__name__)

#: the remote tier's own counters (``stats()["tiers"]["remote"]``)
REMOTE_COUNTERS = ("errors", "timeouts", "checksum_failures", "skipped_degraded", "skipped_node_down", "backoffs")


class RemoteTier(Tier):
    """Records on a :class:`~ectier.tiers.remote.backend.RemoteBackend`, with a deadline and back-off.

    Args:
        config: :class:`~ectier.config.RemoteTierConfig`.
        backend: the store's client.
        clock: monotonic seconds (tests inject one).
    """

    name = "remote"
    local = False

    def __init__(self, config: RemoteTierConfig, backend: RemoteBackend,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.backend = backend
        self._clock = clock
        self._codec = RawCodec()
        self._lock = threading.Lock()
        self._backoff_until = 0.0
        self._refused_warned_until = 0.0  # refusals (RemoteRefused): one warning per backoff_s
        self._warned = False
        self.counters = dict.fromkeys(REMOTE_COUNTERS, 0)
        self.latency = LatencyHistogram(("put", "get", "exists", "delete"))  # of the calls made

    # ------------------------------------------------------------------- the Tier protocol
    @property
    def capacity_bytes(self) -> int:
        """The largest entry written remotely (the store keeps its own budget)."""
        return self.config.max_entry_bytes

    @property
    def used_bytes(self) -> int:
        return 0  # not known without I/O: the store's own figure

    def __len__(self) -> int:
        return 0

    def fits(self, nbytes: int) -> bool:
        return nbytes + HEADER_ALLOWANCE_BYTES <= self.config.max_entry_bytes

    def holds(self, digest: bytes, version: int) -> bool:
        return False  # never known without I/O; a local lookup does not wait on the network

    def stored_version(self, digest: bytes) -> int | None:
        return None

    def describe(self) -> dict[str, Any]:
        with self._lock:
            counters = dict(self.counters)
        return {**counters, **self.backend.describe(), "prefix": self.config.prefix, "degraded": self.degraded,
                "capacity_bytes": self.capacity_bytes, "used_bytes": 0, "entries": 0,
                "latency": self.latency.snapshot()}

    def close(self) -> None:
        self.backend.close()

    # ------------------------------------------------------------------- calls
    def key_of(self, digest: bytes) -> str:
        """The object key of an entry: the hex digest of its namespace and key (the backend adds
        ``remote.prefix`` and its own layout around it)."""
        return digest.hex()

    @property
    def degraded(self) -> bool:
        """In back-off after a failure: calls are skipped until it ends."""
        return self._clock() < self._backoff_until

    def _call(self, what: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """``(True, result)``, or ``(False, None)`` when skipped or failed (counted, back-off)."""
        if self.degraded:
            self._count(skipped_degraded=1)
            return False, None
        t0 = time.perf_counter()
        try:
            result = fn()
        except RemoteError as exc:
            self.latency.observe(what, time.perf_counter() - t0)
            self._fail(what, exc)
            return False, None
        self.latency.observe(what, time.perf_counter() - t0)
        with self._lock:
            if self._warned:
                log.warning("remote tier: %s is answering again", self.backend.describe().get("addresses", "the store"))
                self._warned = False
        return True, result

    def _fail(self, what: str, exc: RemoteError) -> None:
        if isinstance(exc, RemoteNodeError):  # one node: the backend backs it off, the others serve
            self._count(**{"skipped_node_down" if exc.skipped else
                           "timeouts" if isinstance(exc, RemoteTimeout) else "errors": 1})
            return
        if isinstance(exc, RemoteRefused):  # the store answered: this call failed, the store is up
            with self._lock:
                self.counters["errors"] += 1
                warn = self._clock() >= self._refused_warned_until
                if warn:
                    self._refused_warned_until = self._clock() + self.config.backoff_s
            if warn:
                log.warning("remote tier: the store refused a %s (%s); counted in errors, no back-off", what, exc)
            return
        with self._lock:
            self.counters["timeouts" if isinstance(exc, RemoteTimeout) else "errors"] += 1
            self.counters["backoffs"] += 1
            self._backoff_until = self._clock() + self.config.backoff_s
            first = not self._warned
            self._warned = True
        if first:  # one line per outage, not one per call
            log.warning("remote tier: %s failed (%s); remote calls are misses for %.1f s, then retried",
                        what, exc, self.config.backoff_s)

    def _count(self, **amounts: int) -> None:
        with self._lock:
            for k, n in amounts.items():
                self.counters[k] += n

    def write(self, meta: EntryMeta, src: torch.Tensor, version: int, digest: bytes, *,
              payload_checksum: int | None = None) -> bool:
        """Write version ``version`` of an entry (``src``: its flat ``uint8`` CPU bytes). True if stored.

        ``payload_checksum``: the xxh3-64 of ``src`` when the caller knows it (the checksum of the
        entry's raw NVMe record of this version): the record carries it and nobody makes a pass
        over ``src`` for it. Give it only where it is truly the checksum of these bytes: a wrong
        one makes the object fail its check on every read (a counted miss, never a wrong tensor)."""
        known = payload_checksum is not None
        record = encode_record(self._codec, meta, src, version,  # else computed here or while copied
                               with_checksum=not known and not self.backend.computes_checksum)
        header = dataclasses.replace(record.header, payload_checksum=payload_checksum) if known else record.header
        ok, _ = self._call("put", lambda: self.backend.put_record(self.key_of(digest), header, record.payload,
                                                                   deadline_s=self.config.timeout_s,
                                                                   checksum_known=known))
        return ok

    def fetch(self, digest: bytes, namespace: str, key: str):
        """``(header, data)`` — ``data`` a flat ``uint8`` CPU tensor of ``header.raw_nbytes`` bytes,
        not shared with anything else — or ``None`` on a miss (absent, skipped, failed, or a record
        that fails its checks: counted).

        A raw (uncompressed) record read into a writable buffer (Mooncake's ``get_into``) is handed
        out without a copy: ``data`` is a view of the fetched buffer past the header (its address
        need not be aligned). Otherwise (a read-only ``bytes`` from Redis, a compressed payload) the
        payload is decoded into a new tensor. The checks come first either way: the header, the
        namespace and key, the length, and the xxh3 checksum of the payload (one pass)."""
        try:
            ok, raw = self._call("get", lambda: self.backend.get(self.key_of(digest), deadline_s=self.config.timeout_s))
        except CorruptRecordError as exc:  # the backend's own checks (a chunked object's manifest)
            self._count(checksum_failures=1)
            log.warning("remote tier: the object for a key failed its checks (%s); read as a miss", exc)
            return None
        if not ok or raw is None:
            return None
        try:
            mv = memoryview(raw)
            if mv.ndim != 1 or mv.format != "B":
                mv = mv.cast("B")
            n = header_nbytes(mv)
            rec = verify_record((namespace, key), mv[:n], mv[n:])
            h = rec.header
            if not h.raw_nbytes:
                out = torch.empty(0, dtype=torch.uint8)
            elif h.codec_id == self._codec.codec_id and h.payload_nbytes == h.raw_nbytes and not mv.readonly:
                out = torch.frombuffer(mv[n:n + h.raw_nbytes], dtype=torch.uint8)  # no copy
            else:
                out = torch.empty(h.raw_nbytes, dtype=torch.uint8)
                rec.codec.decode_into(mv[n:], out.numpy(), rec.itemsize)
        except (CorruptRecordError, UnknownCodecError, ValueError) as exc:
            self._count(checksum_failures=1)
            log.warning("remote tier: the object for a key failed its checks (%s); read as a miss", exc)
            return None
        return rec.header, out

    def exists(self, digest: bytes) -> bool:
        ok, found = self._call("exists", lambda: self.backend.exists(self.key_of(digest),
                                                                      deadline_s=self.config.timeout_s))
        return bool(ok and found)

    def delete(self, digest: bytes) -> bool:
        ok, _ = self._call("delete", lambda: self.backend.delete(self.key_of(digest),
                                                                  deadline_s=self.config.timeout_s))
        return ok
