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

from ..errors import CorruptRecordError
from .nvme_record import parse_index_value

__all__ = ["GroupCommit", "Pending", "put_entry"]


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

    def submit(self, item: Any, abandon: Callable[[], None]) -> Any:
        """Commit ``item`` with its group; returns its result or raises its error.

        ``abandon()`` is called when the entry is not committed and this raises (its commit
        failed, or an exception from a signal handler reached this writer while it waited): the
        caller gives back what the entry would have named. An exception that reaches a writer whose
        entry a leader is committing right now waits for that commit: if the entry was committed
        it stands (``abandon`` is not called) and the exception is raised all the same."""
        p = Pending(item)
        try:
            return self._submit(p)
        except BaseException:
            if not (p.done and p.error is None and p.result is not None):
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
        try:
            self._commit(batch)
        except BaseException as exc:  # noqa: BLE001 - handed to every entry of the group
            for q in batch:
                if q.result is None and q.error is None:
                    q.error = exc
        finally:
            with self._cond:
                for q in batch:
                    q.done = True
                self.groups += 1
                self.entries += len(batch)
                self._leading = False
                self._cond.notify_all()
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
