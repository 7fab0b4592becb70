"""Write-through under churn: several threads overwrite, delete and read a few keys of a cache in
``nvme.write_through`` mode whose host tier is small enough to evict (and, in one variant, whose
NVMe budget evicts too), while a watcher reads LMDB directly, as a process killed at that instant
would find it at its restart (``testing_internals.nvme_headers_in_lmdb``).

Every put writes a tensor whose length names the put (``_length``), so a record's header says
which put it holds. Ops are stamped on one logical clock at their start and their end; put A is
*dominated* by op X of its key when A ended before X started (X is ordered after A). Checked:

- at every instant: no NVMe record holds a put dominated by an op that had completed before the
  look (a restart never serves bytes older than a completed put, nor bytes a completed delete
  removed); without NVMe evictions, a key with a completed put that no delete overlaps or follows
  has a record (a completed write-through put survives a kill);
- every get serves a put not dominated by an op completed before the get began;
- once idle: ``testing.check_invariants``, then the same checks on LMDB, and after a reopen.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass

import pytest

from ectier import TieredCache, testing
from ectier.errors import TierWriteError
from ectier.testing_internals import nvme_headers_in_lmdb

from conftest import KiB, MiB, filled, make_config

KEYS = ("k0", "k1", "k2", "k3")
UNIT = 8 * KiB  # entry lengths: a multiple of UNIT plus the put's id (< UNIT)
NS = "test"
#: ``ECTIER_STRESS_SEEDS=30`` runs seeds 0..29 (a longer hunt); by default two seeds, ~1 s each
SEEDS = range(int(os.environ["ECTIER_STRESS_SEEDS"])) if os.environ.get("ECTIER_STRESS_SEEDS") else [1, 2]


def _length(pid: int, rng: random.Random) -> int:
    return UNIT * rng.randrange(1, 10) + pid  # one or two 64 KiB blocks


def _pid(length: int) -> int:
    return length % UNIT


@dataclass
class Op:
    kind: str  # "put" / "delete"
    key: str
    pid: int
    start: int
    end: float = float("inf")  # (inf: not returned yet)
    failed: bool = False


class History:
    """Every put and delete, stamped on one logical clock at start and end (under one lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.clock = 0
        self.ops: list[Op] = []
        self.puts: dict[int, Op] = {}

    def begin(self, kind: str, key: str, pid: int = -1) -> Op:
        with self.lock:
            self.clock += 1
            op = Op(kind, key, pid, self.clock)
            self.ops.append(op)
            if kind == "put":
                self.puts[pid] = op
            return op

    def end(self, op: Op, failed: bool = False) -> None:
        with self.lock:
            self.clock += 1
            op.end, op.failed = self.clock, failed

    def now(self) -> int:
        with self.lock:
            return self.clock

    def dominated(self, pid: int, key: str, before: float) -> Op | None:
        """An op of ``key`` that ended before ``before`` and started after put ``pid`` ended."""
        with self.lock:
            a = self.puts[pid]
            for x in self.ops:
                if x.key == key and not x.failed and x.end < before and x.start > a.end:
                    return x
        return None

    def must_hold(self, key: str, before: int, after: int) -> Op | None:
        """A put of ``key`` that ended before ``before`` with no delete (started before ``after``)
        overlapping or following it: its key must have a record then."""
        with self.lock:
            ops = [x for x in self.ops if x.key == key and x.start < after]
            for b in ops:
                if b.kind == "put" and not b.failed and b.end < before and not any(
                        d.kind == "delete" and d.end > b.start for d in ops):
                    return b
        return None


def _check_records(history: History, headers: dict, *, before: int, after: int, durable: bool, where: str) -> None:
    for key in KEYS:
        h = headers.get((NS, key))
        if h is not None:
            pid = _pid(h.shape[0])
            x = history.dominated(pid, key, before)
            assert x is None, f"{where}: {key} holds put {pid} v{h.version}, older than the completed {x}; " + repr(
                [o for o in history.ops if o.key == key])
        elif durable:
            b = history.must_hold(key, before, after)
            assert b is None, f"{where}: {key} has no record, though {b} completed"


def _two_phase_put(cache: TieredCache, key: str, value) -> None:
    """The daemon's put: reserve host blocks, fill them, commit."""
    lease = cache.reserve(key, dtype="uint8", shape=tuple(value.shape))
    arena, at = cache.host_arena, 0
    for offset, length in lease.extents:
        arena[offset:offset + length].copy_(value[at:at + length])
        at += length
    cache.commit(lease)


def _worker(cache: TieredCache, history: History, seed: int, n_ops: int, first_pid: int, errors: list) -> None:
    rng = random.Random(seed)
    try:
        for i in range(n_ops):
            key, r = rng.choice(KEYS), rng.random()
            if r < 0.7:
                pid = first_pid + i
                value = filled(_length(pid, rng), pid)
                op = history.begin("put", key, pid)
                try:
                    if rng.random() < 0.3:
                        _two_phase_put(cache, key, value)
                    else:
                        cache.put(key, value)
                except TierWriteError:  # (no room anywhere within admit_wait_s: nothing stored)
                    history.end(op, failed=True)
                else:
                    history.end(op)
            elif r < 0.85:
                op = history.begin("delete", key)
                cache.delete(key)
                history.end(op)
            else:
                started = history.now() + 1
                got = cache.get(key)
                if got is not None:
                    x = history.dominated(_pid(got.numel()), key, started)
                    assert x is None, f"get({key}) served put {_pid(got.numel())}, older than the completed {x}"
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


def _watch(cache: TieredCache, history: History, durable: bool, stop: threading.Event, errors: list,
           looks: list) -> None:
    try:
        while not stop.is_set():
            before = history.now() + 1
            headers = nvme_headers_in_lmdb(cache)
            after = history.now() + 1
            _check_records(history, headers, before=before, after=after, durable=durable, where="instant")
            looks.append(1)
            stop.wait(0.002)  # (a look holds the GIL: back to back, it starves the workers on a busy machine)
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


@pytest.mark.parametrize("nvme_evicts", [False, True], ids=["nvme-roomy", "nvme-evicts"])
@pytest.mark.parametrize("seed", SEEDS)
def test_overwrites_and_deletes_in_write_through_never_leave_an_older_record(tmp_path, seed, nvme_evicts):
    """Four threads, three keys, 60 ops each (puts 70 %, deletes 15 %, gets 15 %), a host tier of
    4 blocks (evicts), NVMe of 4 MiB (never evicts) or 160 KiB (two records: evicts)."""
    cfg = make_config(tmp_path / "nvme", host_bytes=320 * KiB, nvme_bytes=256 * KiB if nvme_evicts else 4 * MiB,
                      write_through=True, admit_wait_s=0.5)
    cache = TieredCache(cfg)
    history, errors, looks, stop = History(), [], [], threading.Event()
    durable = not nvme_evicts
    try:
        watcher = threading.Thread(target=_watch, args=(cache, history, durable, stop, errors, looks))
        watcher.start()
        threads = [threading.Thread(target=_worker, args=(cache, history, seed * 100 + t, 60, 1 + t * 100, errors))
                   for t in range(4)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stop.set()
        watcher.join(10)
        assert not any(t.is_alive() for t in threads), "a put or delete never returned"
        assert not errors, errors
        assert time.monotonic() - started < 60
        assert looks, "the watcher never looked"
        testing.check_invariants(cache)
        done = history.now() + 1
        _check_records(history, nvme_headers_in_lmdb(cache), before=done, after=done, durable=durable, where="idle")
    finally:
        cache.close()
    cache = TieredCache(cfg)
    try:
        for key in KEYS:
            got = cache.get(key)
            if got is not None:
                x = history.dominated(_pid(got.numel()), key, done)
                assert x is None, f"after reopen {key} serves put {_pid(got.numel())}, older than {x}"
            else:
                assert not durable or history.must_hold(key, done, done) is None, f"after reopen {key} is lost"
    finally:
        cache.close()
