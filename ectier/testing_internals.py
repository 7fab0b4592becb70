"""More of what tests use instead of private state (:mod:`ectier.testing` is full): the NVMe tier's
read/write lock and a hook before its record bookkeeping, a hook before a write-through's wait for
newer ones, a copy handle that has failed, the write-version clock, and registries a test may add
to without leaking into other tests.

Like :mod:`ectier.testing`, this module may look inside the cache, its tiers and the library's
module state, so that tests need not. Not for production.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator

from .cache import TieredCache
from .copy import CopyHandle
from .tiers.base import Tier

__all__ = ["nvme_rw_lock", "nvme_headers_in_lmdb", "before_nvme_record", "around_nvme_move", "before_write_through_wait",
           "failed_copy", "version_clock", "isolated_codec_registry", "isolated_model_registry"]


def _nvme(target: "TieredCache | Tier") -> Any:
    return target._stack.get("nvme") if isinstance(target, TieredCache) else target


def nvme_rw_lock(target: "TieredCache | Tier") -> Any:
    """The read/write lock of a cache's (or an NVMe tier's) store: every transaction and segment
    file read or write holds it shared (``with lock.shared():``), a map resize or close holds it
    exclusively (``with lock.exclusive():``); see :class:`ectier.tiers.nvme_env.RWLock`."""
    return _nvme(target)._rw


def nvme_headers_in_lmdb(target: "TieredCache | Tier") -> dict[tuple[str, str], Any]:
    """``(namespace, key) -> RecordHeader`` of every index entry LMDB holds now, read in one read
    transaction: what a process killed at this instant would find at its restart (the in-memory
    record table may lag it). Raises :class:`~ectier.errors.CorruptRecordError` on a damaged entry,
    :class:`~ectier.errors.CacheClosedError` once the store is closed."""
    from .errors import CacheClosedError
    from .tiers.nvme_record import parse_index_value

    nvme = _nvme(target)
    with nvme._rw.shared():
        if nvme._env is None:
            raise CacheClosedError("cache is closed")
        with nvme._env.begin() as txn:
            raw = [bytes(v) for _, v in txn.cursor(db=nvme._meta)]
    headers = (parse_index_value(v)[0] for v in raw)
    return {(h.namespace, h.key): h for h in headers}


@contextlib.contextmanager
def _calling_first(obj: Any, method: str, fn: Callable[..., None]) -> Iterator[None]:
    """While open, ``obj.<method>(*args)`` calls ``fn(*args)`` first (an instance attribute over
    the method; ``fn`` raising skips the method)."""
    real = getattr(obj, method)

    def hooked(*args: Any) -> Any:
        fn(*args)
        return real(*args)

    setattr(obj, method, hooked)
    try:
        yield
    finally:
        delattr(obj, method)


@contextlib.contextmanager
def before_nvme_record(target: "TieredCache | Tier", fn: Callable[[bytes, Any], None]) -> Iterator[None]:
    """Call ``fn(digest, record)`` each time the NVMe tier of ``target`` is about to change its
    in-memory record of ``digest`` (``record`` is the new record, or ``None`` for a removal), before
    the change, from the thread making it, while the context is open. For a put, the LMDB
    transaction of ``record`` has committed by then and the tier's bookkeeping of it has not begun
    (a crash point). ``fn`` may block (e.g. until the process is killed); if it raises, the change
    is not made."""
    with _calling_first(_nvme(target), "_set_record", fn):
        yield


@contextlib.contextmanager
def around_nvme_move(target: "TieredCache | Tier", before: Callable[[bytes], None] | None = None,
                     after: Callable[[bytes, bool], None] | None = None) -> Iterator[None]:
    """While the context is open, each move of a record below the budget's end of a grown segment
    file (:mod:`ectier.tiers.nvme_compact`) by the NVMe tier of ``target`` calls ``before(digest)``
    once the copy is written and synced, before the index transaction naming it begins, and
    ``after(digest, committed)`` once that transaction is over, before the old blocks are freed
    (crash points; either may block until the process is killed)."""
    nvme = _nvme(target)
    real = nvme._commit_move

    def hooked(digest: bytes, *args: Any) -> bool:
        if before is not None:
            before(digest)
        committed = real(digest, *args)
        if after is not None:
            after(digest, committed)
        return committed

    nvme._commit_move = hooked
    try:
        yield
    finally:
        del nvme._commit_move


@contextlib.contextmanager
def before_write_through_wait(cache: TieredCache, fn: Callable[[bytes, int], None]) -> Iterator[None]:
    """Call ``fn(digest, version)`` each time a put's write-through of ``version`` that did not
    land (a newer put of the key committed before it wrote, or its write failed) is about to wait
    for the newer write-throughs of the key (``NvmeMoves.await_newer_locked``), while the context
    is open. ``fn`` runs in the put's thread under the cache's lock, so it must not block; a put
    of the key that commits after ``fn`` returned commits while that write-through waits."""
    with _calling_first(cache._mover.nvme, "await_newer_locked", fn):
        yield


def failed_copy(error: BaseException) -> CopyHandle:
    """A :class:`~ectier.copy.CopyHandle` already complete with ``error``: what a copy engine
    returns for a batch whose copies failed (``done()`` is true, ``error`` is ``error``)."""
    handle = CopyHandle()
    handle._finish(error)
    return handle


@contextlib.contextmanager
def version_clock(time_ns: Callable[[], int] | None = None, *, last: int | None = None) -> Iterator[None]:
    """Inside: :func:`ectier.entry.next_version` reads ``time_ns()`` (nanoseconds) instead of the
    wall clock, e.g. one that stalls, goes back or runs behind (``None``: the clock it reads stays);
    with ``last``, this process's version counter starts at ``last`` (``0``: a fresh process).
    After: the clock it read before, and the counter back where it was when the context was
    entered, whatever versions were stamped inside."""
    from . import entry

    with entry._version_lock:
        saved = entry._last_version
        if last is not None:
            entry._last_version = last
    clock = entry.time
    if time_ns is not None:
        entry.time = types.SimpleNamespace(time_ns=time_ns)
    try:
        yield
    finally:
        entry.time = clock
        with entry._version_lock:
            entry._last_version = saved


@contextlib.contextmanager
def _dicts_restored(lock: Any, *dicts: dict) -> Iterator[None]:
    """Inside: ``dicts`` may change; after: each holds exactly what it held before (in place, under
    ``lock``: views of them stay views)."""
    with lock:
        saved = [dict(d) for d in dicts]
    try:
        yield
    finally:
        with lock:
            for d, before in zip(dicts, saved):
                d.clear()
                d.update(before)


def isolated_codec_registry() -> contextlib.AbstractContextManager[None]:
    """Inside: codecs may be registered (:func:`ectier.codec.register_codec`) as usual; after: the
    registry holds exactly the codecs it held before, so a test's codecs do not leak into others."""
    from . import codec

    return _dicts_restored(codec._REGISTRY_LOCK, codec._BY_ID, codec._BY_NAME)


def isolated_model_registry() -> contextlib.AbstractContextManager[None]:
    """Inside: models may be registered (:func:`ectier.models.register_model`) as usual; after: the
    registry (and :data:`ectier.models.MODELS`, a view of it) holds exactly the models, names and
    aliases it held before, so a test's models do not leak into others."""
    from . import models

    return _dicts_restored(models._lock, models._models, models._lookup)
