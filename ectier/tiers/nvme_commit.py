"""Group commit for the NVMe tier: writes that reach their index commit together share one
``fdatasync`` of the segment file and one LMDB commit (one sync of ``data.mdb``).

A writer copies its payload into the segment file (inside :meth:`GroupCommit.copying`), then
:meth:`GroupCommit.submit` s its index entry. The first writer to find no commit running becomes the
leader: it waits up to ``nvme.group_commit_s`` seconds while other writers are still copying their
payloads (so that they join), takes every entry queued so far, syncs the payloads, commits all the
entries in one transaction and wakes their writers; writers that arrive meanwhile form the next
group. With one writer there is nothing to wait for: the leader commits at once, and the latency
added to any write is bounded by ``nvme.group_commit_s``. Each write still returns only once its
own entry is durable: the promise of ``nvme.write_through`` / ``nvme.sync`` is unchanged.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import lmdb

from ..errors import CorruptRecordError, EctierError, TierWriteError
from .nvme_errors import lmdb_write_error
from .nvme_index import NvmeRecord
from .nvme_record import pack_index_value, parse_index_value
from .nvme_segment import pack_location

__all__ = ["GroupCommit", "IndexCommits", "Pending", "put_entry", "committed_entries", "record_committed"]


@dataclass
class Pending:
    """One index entry waiting for its group: what to commit (``item``, the caller's), and once done
    its ``result`` or ``error``."""

    item: Any
    result: Any = None
    error: BaseException | None = None
    done: bool = field(default=False)


class GroupCommit:
    """The queue and the leader hand-off (see the module docstring).

    Args:
        commit: ``commit(batch)`` syncs the payloads and commits a list of :class:`Pending`, setting
            each one's ``result`` (or ``error``); an exception it raises fails every entry not yet set.
        max_wait_s: how long a leader waits for writers still copying (``nvme.group_commit_s``).
    """

    def __init__(self, commit: Callable[[list[Pending]], None], max_wait_s: float) -> None:
        self._commit = commit
        self.max_wait_s = max_wait_s
        self._cond = threading.Condition()
        self._queue: list[Pending] = []
        self._leading = False
        self._copying = 0
        self.groups = 0  # commits made (a group of one counts too)
        self.entries = 0  # entries committed through them

    @contextmanager
    def copying(self) -> Iterator[None]:
        """Mark a writer copying its payload (a leader waits for it to join, up to ``max_wait_s``)."""
        with self._cond:
            self._copying += 1
        try:
            yield
        finally:
            with self._cond:
                self._copying -= 1
                self._cond.notify_all()

    def submit(self, item: Any, abandon: Callable[[], None], stands: Callable[[Any], None]) -> Any:
        """Commit ``item`` with its group; returns its result or raises its error.

        ``abandon()`` is called when the entry is not committed and this raises (its commit
        failed, or an exception from a signal handler reached this writer while it waited): the
        caller gives back what the entry would have named. An exception that reaches a writer whose
        entry a leader is committing right now waits for that commit: if the entry was committed
        it stands, ``stands(result)`` is called instead (the caller gives back what the entry
        replaced) and the exception is raised all the same."""
        p = Pending(item)
        try:
            return self._submit(p)
        except BaseException:
            if p.done and p.error is None and p.result is not None:
                stands(p.result)
            else:
                abandon()
            raise

    def _submit(self, p: Pending) -> Any:
        with self._cond:
            self._queue.append(p)
            self._cond.notify_all()
            try:
                while not p.done and self._leading:
                    self._cond.wait()
                if p.done:
                    return self._outcome(p)
                self._leading = True
                try:
                    deadline = time.monotonic() + self.max_wait_s
                    while self._copying > 0 and (left := deadline - time.monotonic()) > 0:
                        self._cond.wait(left)
                except BaseException:
                    self._leading = False  # a queued writer takes over (woken below)
                    raise
                batch, self._queue = self._queue, []
            except BaseException:
                self._withdraw_locked(p)
                raise
        failure = None
        try:
            self._commit(batch)
        except BaseException as exc:  # noqa: BLE001 - handed to every entry of the group not committed
            failure = exc
            others = exc if isinstance(exc, (EctierError, OSError)) else TierWriteError(
                f"nvme tier: the group commit was cut in another thread ({type(exc).__name__}: {exc}); not stored")
            for q in batch:
                if q.result is None and q.error is None:
                    q.error = exc if q is p else others
        finally:
            with self._cond:
                for q in batch:
                    q.done = True
                self.groups += 1
                self.entries += len(batch)
                self._leading = False
                self._cond.notify_all()
        if failure is not None and p.error is None:
            raise failure  # (this writer's entry was committed before the exception: it stands)
        return self._outcome(p)

    def _withdraw_locked(self, p: Pending) -> None:
        """``p``'s writer leaves on an exception: out of the queue if no leader took it yet, else
        once its group's commit is over (``p.done``: the caller then knows whether it stands)."""
        self._cond.notify_all()
        if p in self._queue:
            self._queue.remove(p)
            return
        while not p.done:
            try:
                self._cond.wait()
            except BaseException:  # noqa: BLE001 - another one: the first is being raised already
                continue

    @staticmethod
    def _outcome(p: Pending) -> Any:
        if p.error is not None:
            raise p.error
        return p.result


def put_entry(txn: Any, db: object, item: tuple, value: bytes) -> tuple[bool, Any]:
    """In write transaction ``txn``: put the index entry ``value`` of ``item`` (``(digest, header,
    location)``) into ``db`` unless an equal or newer version is there. ``(written, location of the
    entry it replaced or None)``."""
    digest, header, _ = item
    current = txn.get(digest, db=db)
    old = None
    if current is not None:
        try:
            cur_header, old = parse_index_value(current)
            if cur_header.version >= header.version:
                return False, None
        except CorruptRecordError:
            old = None  # replaced below; its blocks come back at the next open
    txn.put(digest, value, db=db)
    return True, old


def committed_entries(env: Any, db: object, batch: list[Pending], values: list[bytes],
                      results: list[tuple[bool, Any]]) -> list[tuple[Pending, bytes]]:
    """After an exception cut the commit of ``batch`` (``values``: their index values): the
    entries that the store holds byte for byte, i.e. whose commit happened. Each of them without a
    ``result`` gets its entry of ``results`` (what :func:`put_entry` returned in the transaction,
    complete whenever that transaction committed) or ``(True, None)`` when there is none (the
    record it replaced is not known: its blocks come back at the next open). ``[]`` when the store
    cannot be read (closed meanwhile)."""
    try:
        txn = env.begin()
        try:
            held = [txn.get(p.item[0], db=db) for p in batch]
        finally:
            txn.abort()
    except Exception:  # noqa: BLE001 - closed or failing: nothing can be said, nothing is claimed
        return []
    out = []
    for i, (p, value, now) in enumerate(zip(batch, values, held)):
        if now is not None and bytes(now) == value:
            if p.result is None and p.error is None:
                p.result = results[i] if len(results) == len(batch) else (True, None)
            out.append((p, value))
    return out


def record_committed(index: Any, set_record: Callable[[bytes, Any], None], entries: list[tuple[Pending, bytes]]) -> None:
    """Set the in-memory records (``set_record(digest, NvmeRecord)``) of committed ``(entry, index
    value)`` pairs; one already in ``index`` with that value is left as it is."""
    for p, value in entries:
        digest, header, loc = p.item
        rec = index.record(digest)
        if rec is None or rec.value != value:
            set_record(digest, NvmeRecord(header, len(value) - len(pack_location(loc)) + loc.alloc_bytes, loc, value))


class IndexCommits:
    """Mixin of :class:`~ectier.tiers.nvme.NvmeTier`: the commit a :class:`GroupCommit` leader runs
    (uses the tier's ``_segment_io``, ``_rw``, ``_write_lock``, ``_check_open``, ``_env``,
    ``_meta``, ``_store``, ``index``, ``_set_record``, ``counters``, ``path``, ``_free_disk_bytes``)."""

    def _commit_group(self, batch: list[Pending]) -> None:
        """Sync the payloads of ``batch`` (``fdatasync`` with ``nvme.sync``), then commit their
        index entries in one LMDB transaction, each conditional on its version: ``result`` is
        ``(written, location of the record it replaced)``."""
        self._segment_io("flush")
        values = [pack_index_value(h, loc) for _, h, loc in (p.item for p in batch)]
        need = sum(len(v) for v in values)
        released = False  # one commit may make pages freed by earlier deletes reusable
        for _ in range(64):
            with self._rw.shared(), self._write_lock:
                self._check_open()
                results = []
                try:
                    with self._env.begin(write=True) as txn:
                        for p, value in zip(batch, values):
                            results.append(put_entry(txn, self._meta, p.item, value))
                except lmdb.MapFullError:
                    if not released:
                        released = True
                        if self._store.release_freed_pages():
                            continue  # retry once before growing: the freed pages may be enough
                except lmdb.Error as exc:
                    self.counters["write_errors"] += 1
                    raise lmdb_write_error(self.path, exc, need, self._free_disk_bytes()) from None
                except BaseException:  # (a signal handler's exception, possibly right after the commit)
                    self._settle(batch, values, results)
                    raise
                else:
                    try:
                        for p, result in zip(batch, results):
                            p.result = result
                        self._store.reserve.keep()  # what LMDB grew into is held again, if there is room
                        record_committed(self.index, self._set_record,
                                         [(p, value) for p, value, (done, _) in zip(batch, values, results) if done])
                    except BaseException:
                        self._settle(batch, values, results)
                        raise
                    return
            self._store.grow(need)
        raise TierWriteError("nvme tier: map still full after growing")  # pragma: no cover

    def _settle(self, batch: list[Pending], values: list[bytes], results: list[tuple[bool, Any]]) -> None:
        """A group's commit cut by an exception: what LMDB committed of it stands (results, records)."""
        record_committed(self.index, self._set_record, committed_entries(self._env, self._meta, batch, values, results))

