"""The daemon never makes a client wait on another's I/O or reservations (issue #14, items 1 and 8).

- ``prefetch`` answers at once while the daemon promotes NVMe → arena in its own threads; a
  ``get`` of a ready entry then takes the promotion's pin and reads no NVMe (a daemon whose NVMe
  reads are slowed, ``tests/slow_nvme_daemon.py``, makes any NVMe wait show);
- the pins a promotion holds end (a get, an overwrite, ``daemon.lease_s``) and never leak;
- an entry larger than the host arena sitting on NVMe is served (a scratch file), so ``contains``
  and ``get`` agree; a protocol-1 client (no ``direct``) gets the old answers, with a log line;
- one client's open reservation does not make another client's put fail: it goes to NVMe.

Every daemon is a real process (tests/daemon_helpers.py).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from conftest import make_config
from ectier import CacheConfig, LoadHandle, TieredCache, testing, testing_daemon
from ectier.daemon.prefetch import Prefetcher
from ectier.daemon.client import DaemonClient
from ectier.errors import TierWriteError
from daemon_helpers import (MiB, DaemonProcess, RawConn, assert_same, daemon_config, daemon_process, daemon_stats,
                            make_tensor, remove_dir, serve_in_thread, short_tmpdir, wait_for, write_config)

DELAY_S = 3.0  # every NVMe payload read of the slowed daemon takes at least this long
FAST_S = DELAY_S / 2  # a call that waits on no NVMe read returns well within this (it takes ~ms)


def daemon(via: str = "module", **kw):
    """A daemon in a fresh directory; ``via="slow-nvme"``: NVMe reads DELAY_S late. Yields the
    process (``.dir``, ``.cfg``, ``.path``: its config file) and removes everything after."""
    return daemon_process(via=via, nvme_read_delay_s=DELAY_S, **kw)


def restart(proc: DaemonProcess, via: str) -> DaemonProcess:
    """Stop ``proc`` (SIGTERM: host entries are flushed to NVMe) and start a daemon on the same
    config and directory: its entries are on NVMe only."""
    assert proc.terminate() == 0, proc.log()
    new = DaemonProcess(proc.path, proc.socket_path, via=via, nvme_read_delay_s=DELAY_S)
    new.dir, new.cfg, new.path = proc.dir, proc.cfg, proc.path
    return new.start()


def timed(fn, *args, **kw):
    t0 = time.monotonic()
    out = fn(*args, **kw)
    return out, time.monotonic() - t0


def scratch_files(directory: str) -> list[str]:
    return [n for n in os.listdir(directory) if ".scratch-" in n]


@pytest.fixture
def nvme_only():
    """A slowed daemon whose NVMe holds ``a`` and ``b`` (2 MiB each) and nothing else: yields
    ``(proc, {key: tensor})``."""
    with daemon(host_bytes=16 * MiB) as first:
        values = {k: make_tensor(i, "bfloat16", (128, 8192)) for i, k in enumerate("ab")}
        with DaemonClient(first.socket_path) as c:
            for k, v in values.items():
                c.put(k, v)
        proc = restart(first, "slow-nvme")
        try:
            yield proc, values
        finally:
            proc.stop()


def test_a_get_of_an_nvme_only_entry_waits_on_the_slowed_read(nvme_only):
    """The knob works: without a prefetch, a get promotes synchronously and takes DELAY_S."""
    proc, values = nvme_only
    with DaemonClient(proc.socket_path) as c:
        got, seconds = timed(c.get, "a")
    assert_same(got, values["a"])
    assert seconds >= DELAY_S


def test_prefetch_answers_at_once_and_the_get_after_it_reads_no_nvme(nvme_only):
    proc, values = nvme_only
    with DaemonClient(proc.socket_path) as c:
        c.connect()
        assert {"prefetch", "direct"} <= c.features
        states, seconds = timed(c.prefetch, ["a", "b", "nowhere"])
        assert states == ["promoting", "promoting", "absent"]
        assert seconds < FAST_S
        # asking again costs nothing either, and starts nothing twice
        states, seconds = timed(c.prefetch, ["a", "b"])
        assert seconds < FAST_S and set(states) <= {"promoting", "ready"}
        wait_for(lambda: c.prefetch(["a", "b"]) == ["ready", "ready"], timeout=4 * DELAY_S + 10,
                 what="both promotions")
        for key in "ab":
            got, seconds = timed(c.get, key)
            assert_same(got, values[key])
            assert seconds < FAST_S  # the promotion's pin, taken over: no NVMe read
        p = c.stats()["daemon"]["prefetch"]
    assert (p["started"], p["promoted"], p["taken"], p["held"]) == (2, 2, 2, 0)


def test_a_prefetch_pin_survives_arena_churn_until_its_get(nvme_only):
    """The promoted entry is pinned for the get: puts that fill the arena twice over demote
    everything else, not it, and the get still reads no NVMe."""
    proc, values = nvme_only
    with DaemonClient(proc.socket_path) as c:
        c.prefetch(["a"])
        wait_for(lambda: c.prefetch(["a"]) == ["ready"], timeout=2 * DELAY_S + 10, what="the promotion")
        for i in range(16):
            c.put(f"churn{i}", make_tensor(100 + i, "uint8", (2 * MiB,)))
        got, seconds = timed(c.get, "a")
    assert_same(got, values["a"])
    assert seconds < FAST_S


def test_held_pins_end_with_lease_s_and_on_overwrite():
    with daemon(host_bytes=16 * MiB, lease_s=0.5) as first:
        with DaemonClient(first.socket_path) as c:
            c.put("a", make_tensor(1, "uint8", (MiB,)))
            c.put("b", make_tensor(2, "uint8", (MiB,)))
        proc = restart(first, "module")
        try:
            with DaemonClient(proc.socket_path) as c:
                c.prefetch(["a", "b"])
                wait_for(lambda: c.prefetch(["a", "b"]) == ["ready", "ready"], what="the promotions")
                newer = make_tensor(3, "float32", (1000,))
                c.put("b", newer)  # the held pin of the old b is let go
                assert_same(c.get("b"), newer)
                stats = wait_for(lambda: (lambda s: s if s["daemon"]["prefetch"]["held"] == 0 else None)(c.stats()),
                                 what="the held pin of a to expire")
                assert stats["daemon"]["prefetch"]["expired"] == 1
                assert stats["daemon"]["leases"] == {"put": 0, "get": 0}
                assert c.get("a") is not None  # still stored, only unpinned
        finally:
            proc.stop()


# ------------------------------------------------------------------ larger than the host arena


@pytest.fixture
def too_large():
    """A daemon with an 8 MiB arena over an NVMe store holding ``big`` (32 MiB, written by an
    in-process cache with a larger arena): yields ``(proc, tensor)``."""
    d = short_tmpdir()
    try:
        cfg = daemon_config(d, host_bytes=8 * MiB, nvme_bytes=128 * MiB)
        big = make_tensor(7, "bfloat16", (2048, 8192))
        writer = CacheConfig.from_dict({**cfg, "host": {**cfg["host"], "capacity_bytes": 64 * MiB}, "daemon": {}})
        with TieredCache(writer) as cache:
            cache.put("big", big)
        proc = DaemonProcess(write_config(os.path.join(d, "cfg.json"), cfg), cfg["daemon"]["socket_path"])
        proc.dir = d
        try:
            yield proc.start(), big
        finally:
            proc.stop()
    finally:
        remove_dir(d)


def test_an_entry_larger_than_the_arena_is_served_so_contains_agrees_with_get(too_large):
    proc, big = too_large
    with DaemonClient(proc.socket_path) as c:
        assert c.contains("big")
        for _ in range(2):
            assert_same(c.get("big"), big)
        assert c.prefetch(["big"]) == ["promoting"]
        wait_for(lambda: c.prefetch(["big"]) == ["ready"], what="the direct read")
        assert len(scratch_files(proc.dir)) == 1  # held for the next get
        assert_same(c.get("big"), big)
        assert c.stats()["daemon"]["prefetch"]["direct_reads"] == 1
    assert scratch_files(proc.dir) == []


def test_held_scratch_files_keep_to_the_arena_size_or_one_file():
    """Direct reads of entries larger than the arena hold scratch files in daemon.shm_dir for the
    next get: together at most host.capacity_bytes, or one file (found by a probe: 8 such files,
    52 MiB of /dev/shm for a 4 MiB arena, uncounted). Past that a key is answered absent once,
    and a direct get still serves it."""
    d = short_tmpdir()
    try:
        cfg = daemon_config(d, host_bytes=4 * MiB, nvme_bytes=128 * MiB)
        values = {f"H{i}": make_tensor(i, "uint8", (6 * MiB,)) for i in range(4)}
        writer = CacheConfig.from_dict({**cfg, "host": {**cfg["host"], "capacity_bytes": 64 * MiB}, "daemon": {}})
        with TieredCache(writer) as cache:
            for k, v in values.items():
                cache.put(k, v)
        proc = DaemonProcess(write_config(os.path.join(d, "cfg.json"), cfg), cfg["daemon"]["socket_path"]).start()
        try:
            _prefetch_past_the_scratch_budget(proc, d, values)
        finally:
            proc.stop()
        assert scratch_files(d) == []
    finally:
        remove_dir(d)


def _prefetch_past_the_scratch_budget(proc, d, values):
    with DaemonClient(proc.socket_path) as c:
        keys = list(values)
        def settled():
            st = c.prefetch(keys)
            return None if "promoting" in st else st

        states = wait_for(settled, timeout=30, what="the direct reads")
        pre = c.stats()["daemon"]["prefetch"]
        assert states.count("ready") == 1 and states.count("absent") == 3, states
        assert len(scratch_files(d)) == 1 and pre["held_scratch_bytes"] == 6 * MiB
        assert pre["scratch_refused"] == 3 and pre["direct_reads"] == 1
        assert pre["failed"] == 0  # a refusal is not a failure too (it was counted as both)
        assert c.prefetch(keys) == states and c.stats()["daemon"]["prefetch"]["scratch_refused"] == 3  # no reads
        for k, v in values.items():
            assert_same(c.get(k), v)  # held or not, served
        assert c.stats()["daemon"]["prefetch"]["held_scratch_bytes"] == 0
        assert "promoting" in c.prefetch(keys[1:])  # the held file is let go: the refused are read again


def test_a_protocol_1_client_misses_it_with_one_log_line(too_large):
    """Without ``direct`` a client never sees a scratch file, not even one a direct client's
    prefetch holds: its gets miss (as protocol 1 always answered), and the daemon says why once."""
    proc, big = too_large
    with RawConn(proc.socket_path) as raw, DaemonClient(proc.socket_path) as c:
        assert raw.request({"id": 1, "op": "contains", "key": "big"})["found"]
        assert raw.request({"id": 2, "op": "prefetch", "keys": ["big"]})["states"] == ["absent"]
        c.prefetch(["big"])
        wait_for(lambda: c.prefetch(["big"]) == ["ready"], what="the direct read")
        for i in range(3):
            assert raw.request({"id": 3 + i, "op": "get", "key": "big"}) == {"id": 3 + i, "ok": True, "hit": False}
        assert_same(c.get("big"), big)
    lines = [line for line in proc.log().splitlines() if "cannot be leased through the host arena" in line]
    assert len(lines) == 1 and "host.capacity_bytes=8388608" in lines[0], proc.log()


def test_a_put_larger_than_the_arena_goes_to_nvme():
    with daemon(host_bytes=8 * MiB, nvme_bytes=128 * MiB) as proc:
        big = make_tensor(8, "bfloat16", (1024, 8192))  # 16 MiB
        with DaemonClient(proc.socket_path) as c:
            c.put("big", big)
            assert c.stats()["tiers"]["nvme"]["entries"] == 1
            assert_same(c.get("big"), big)
        assert scratch_files(proc.dir) == []


# ------------------------------------------------------------------ other clients' reservations


def test_an_open_reservation_does_not_fail_another_clients_put():
    """Client A holds a reservation of 6 MiB of the 8 MiB arena (and does not commit); client B's
    3 MiB puts cannot fit beside it: they are stored on NVMe, not refused after host.admit_wait_s
    with a message about readers."""
    with daemon(host_bytes=8 * MiB, nvme_bytes=64 * MiB) as proc:
        with DaemonClient(proc.socket_path, client_name="a") as a, DaemonClient(proc.socket_path, client_name="b") as b:
            a.call("reserve", key="open", dtype="uint8", shape=[6 * MiB])
            values = {f"k{i}": make_tensor(i, "uint8", (3 * MiB,)) for i in range(3)}
            for key, value in values.items():
                b.put(key, value)
            for key, value in values.items():
                assert_same(b.get(key), value)
            assert b.stats()["tiers"]["nvme"]["entries"] >= 3


ADMIT_WAIT_S = 3.0


def test_an_open_reservation_does_not_make_another_put_wait():
    """Client A's open 6 MiB reservation leaves 2 MiB of the 8 MiB arena: client B's 3 MiB put goes
    to NVMe at once, not after host.admit_wait_s (3 s here) spent waiting for A to commit."""
    d = short_tmpdir()
    try:
        cfg = daemon_config(d, host_bytes=8 * MiB, nvme_bytes=64 * MiB)
        cfg["host"]["admit_wait_s"] = ADMIT_WAIT_S
        proc = DaemonProcess(write_config(os.path.join(d, "cfg.json"), cfg), cfg["daemon"]["socket_path"]).start()
        try:
            with DaemonClient(proc.socket_path, client_name="a") as a, \
                    DaemonClient(proc.socket_path, client_name="b") as b:
                a.call("reserve", key="open", dtype="uint8", shape=[6 * MiB])
                value = make_tensor(7, "uint8", (3 * MiB,))
                _, took = timed(b.put, "k", value)
                assert took < ADMIT_WAIT_S / 3, f"the put waited {took:.2f} s for another client's reservation"
                assert_same(b.get("k"), value)
                assert b.stats()["tiers"]["nvme"]["entries"] == 1
        finally:
            proc.stop()
    finally:
        remove_dir(d)


def test_an_open_reservation_does_not_make_an_inprocess_put_wait(tmp_path):
    """The same in one process: an open TieredCache.reserve (a two-phase put in progress) holding
    most of the host arena; a put that cannot fit beside it is stored on NVMe at once."""
    cfg = CacheConfig.from_dict({"host": {"capacity_bytes": 8 * MiB, "block_bytes": 64 * 1024, "pin_memory": False,
                                          "admit_wait_s": ADMIT_WAIT_S},
                                 "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": 64 * MiB, "sync": False}})
    with TieredCache(cfg) as cache:
        lease = cache.reserve("open", dtype="uint8", shape=[6 * MiB])
        value = make_tensor(3, "uint8", (3 * MiB,))
        handle, took = timed(cache.put, "k", value)
        assert handle.wait(10) is True
        assert took < ADMIT_WAIT_S / 3, f"the put waited {took:.2f} s for an open reservation"
        assert_same(cache.get("k"), value)
        cache.abort(lease)


def test_without_nvme_the_refusal_names_the_reservations():
    with daemon(host_bytes=8 * MiB, nvme=False) as proc:
        with DaemonClient(proc.socket_path, client_name="a") as a, DaemonClient(proc.socket_path, client_name="b") as b:
            a.call("reserve", key="open", dtype="uint8", shape=[6 * MiB])
            with pytest.raises(TierWriteError, match="reservations"):
                b.put("k", make_tensor(1, "uint8", (3 * MiB,)))


def test_the_hello_reply_lists_the_features():
    with daemon(nvme=False) as proc:
        with RawConn(proc.socket_path) as raw:
            assert set(raw.hello_reply["features"]) == {"prefetch", "direct", "view", "orphans", "bye"}
        assert daemon_stats(proc.socket_path)["daemon"]["prefetch"]["held"] == 0


def test_a_str_where_a_list_of_keys_goes_is_refused_before_anything_is_sent(tmp_path):
    """``prefetch("abc")`` used to prefetch "a", "b" and "c"; like TieredCache.prefetch it raises
    InvalidKeyError, and so do prefetch_and_pin's ``keys`` and ``pin``, without connecting (no
    daemon listens at the path: a connection attempt would raise DaemonUnavailableError)."""
    from ectier.errors import InvalidKeyError

    with TieredCache(make_config(tmp_path)) as cache, pytest.raises(InvalidKeyError) as local:
        cache.prefetch("abc")
    c = DaemonClient(os.path.join(short_tmpdir(), "nobody.sock"), connect_retry_s=0.1)
    calls = [lambda: c.prefetch("abc"), lambda: c.prefetch(b"abc"), lambda: c.prefetch_and_pin("abc", []),
             lambda: c.prefetch_and_pin(["abc"], "abc")]
    try:
        for call in calls:
            with pytest.raises(InvalidKeyError, match="expected a list of keys, got one"):
                call()
        with pytest.raises(InvalidKeyError) as remote:
            c.prefetch("abc")
        assert str(remote.value) == str(local.value)
        assert not c.unreachable  # no connection was tried
    finally:
        c.close()
        remove_dir(os.path.dirname(c.socket_path))


def test_direct_reads_of_a_prefetch_keep_to_prefetch_threads(tmp_path, monkeypatch):
    """Entries larger than the arena are read from NVMe into scratch files by the daemon's own
    prefetch workers, the others promoted by the cache's prefetch pool: together at most
    ``prefetch_threads`` reads at once, each without the read helper (the direct reads ran four
    at once, with the helper, and beside the pool's, whatever the knob said)."""
    import threading

    import ectier.tiers.nvme_segment as seg
    from ectier.config import DaemonConfig, HostTierConfig, NvmeTierConfig

    values = {f"big-{i}": make_tensor(i, "bfloat16", (1024, 8192)) for i in range(5)}  # 16 MiB each
    values.update({f"small-{i}": make_tensor(10 + i, "bfloat16", (128, 8192)) for i in range(3)})  # 2 MiB
    nvme = NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=256 * MiB, sync=False, read_threads=2)
    with TieredCache(CacheConfig(namespace="test", host=HostTierConfig(capacity_bytes=0), nvme=nvme)) as c:
        for k, v in values.items():
            c.put(k, v)
    lock, running, seen = threading.Lock(), [0], []  # seen: (helper given, reads running at once)
    real = seg.read_hashed

    def watched(fd, chunks, helper=None):
        with lock:
            running[0] += 1
            seen.append((helper is not None, running[0]))
        try:
            time.sleep(0.05)  # a second worker would start its read meanwhile
            return real(fd, chunks, helper)
        finally:
            with lock:
                running[0] -= 1

    cfg = CacheConfig(namespace="test", host=HostTierConfig(capacity_bytes=8 * MiB, pin_memory=False), nvme=nvme,
                      daemon=DaemonConfig(socket_path=os.path.join(sock_dir := short_tmpdir(), "d.sock"),
                                          shm_dir=str(tmp_path)),
                      prefetch_threads=1)
    server, thread = serve_in_thread(cfg)
    try:
        monkeypatch.setattr(seg, "read_hashed", watched)
        with DaemonClient(cfg.daemon.socket_path) as client:
            deadline = time.monotonic() + 30
            while "promoting" in (states := client.prefetch(list(values))) and time.monotonic() < deadline:
                time.sleep(0.02)
            # one 16 MiB scratch file is held (the held files keep to the 8 MiB arena, or one file)
            assert states == ["ready", "absent", "absent", "absent", "absent", "ready", "ready", "ready"], states
            assert len(seen) == len(values) and not any(helper for helper, _ in seen)
            assert max(n for _, n in seen) == 1
            for k, v in values.items():
                assert_same(client.get(k), v)
    finally:
        server.stop()
        thread.join(10)
        remove_dir(sock_dir)


# ------------------------------------------------------------ the request's thread never reads


class _EvictedInBetween:
    """A cache whose first ``prefetch`` answers "done, found" (as for an entry in the arena) while
    the entry lies on NVMe only: evicted between that answer and the pin. Records the acquires
    that could promote (I/O) and the thread that made them."""

    def __init__(self, cache: TieredCache) -> None:
        self._cache, self._first = cache, True
        self.promoting_acquires: list[str] = []

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def prefetch(self, keys, **kw):
        if self._first:
            self._first = False
            handle = LoadHandle(keys[0])
            handle.finish(True)
            return [handle]
        return self._cache.prefetch(keys, **kw)

    def acquire(self, key, *, namespace=None, promote=True, count=True):
        if promote:
            self.promoting_acquires.append(threading.current_thread().name)
        return self._cache.acquire(key, namespace=namespace, promote=promote, count=count)


def test_an_entry_evicted_between_answer_and_pin_is_read_by_a_worker(tmp_path):
    with TieredCache(make_config(tmp_path, host_bytes=2 * MiB, nvme_bytes=8 * MiB, block_bytes=64 * 1024)) as real:
        t = make_tensor(3, "bfloat16", (64, 8192))  # 1 MiB
        real.put("k", t)
        real.flush()
        assert testing.drop_copy(real, "host", "k") and testing.where(real, "k") == {"nvme"}
        cache = _EvictedInBetween(real)
        pf = Prefetcher(cache, hold_s=30.0, scratch_dir=str(tmp_path), gid=None)
        try:
            assert pf.states(["k"], None, direct=False) == ["promoting"]  # not "ready", not read here
            me = threading.current_thread().name
            assert me not in cache.promoting_acquires
            wait_for(lambda: pf.states(["k"], None, direct=False) == ["ready"], what="the worker's promotion")
            held = pf.take(None, "k", direct=False)
            assert held is not None and testing.holds(real, "host", "k")
            real.release(held.handle)
        finally:
            pf.close()


def test_a_prefetch_the_instant_a_direct_read_ends_finds_it_ready_and_reads_nothing_again(tmp_path):
    """The worker ended a run (out of ``_running``) and kept its scratch file (into ``_held``)
    under two holds of the lock: a ``prefetch`` in between found the key neither running nor held
    and started a second direct read, refused by the held scratch budget (``scratch_refused``
    counted one more; a CI-style strict count of it could fail). Made certain here: the prefetch
    is asked at the first release of the lock by the worker after the run ended."""
    with TieredCache(make_config(tmp_path / "nvme", host_bytes=2 * MiB, nvme_bytes=16 * MiB)) as cache:
        big = make_tensor(5, "uint8", (4 * MiB,))  # larger than the arena: on NVMe only
        cache.put("big", big)
        cache.flush()
        assert testing.where(cache, "big") == {"nvme"}
        pf = Prefetcher(cache, hold_s=30.0, scratch_dir=str(tmp_path), gid=None)
        answers: list[list[str]] = []

        def ask() -> None:  # the first time a worker lets the lock go after the run ended
            if not answers and not testing_daemon.prefetch_running(pf, "big"):
                answers.append(pf.states(["big"], None, direct=True))

        try:
            with testing_daemon.at_prefetch_worker_unlock(pf, ask):
                assert pf.states(["big"], None, direct=True) == ["promoting"]
                wait_for(lambda: pf.states(["big"], None, direct=True) == ["ready"], timeout=30,
                         what="the direct read")
            assert answers == [["ready"]], answers
            st = pf.stats()
            assert (st["started"], st["direct_reads"], st["scratch_refused"], st["held"]) == (1, 1, 0, 1), st
            held = pf.take(None, "big", direct=True)
            assert held is not None
            held.handle.release()
        finally:
            pf.close()


def test_a_prefetch_counts_no_lookup_and_the_get_that_takes_its_pin_counts_one(tmp_path):
    """Before: the prefetch's pin was counted as a hit (``ectier_lookups_total``) when taken,
    whether or not a get followed, and a get after that pin expired counted a second one."""
    from daemon_helpers import serve_in_thread, short_tmpdir
    import torch

    d = short_tmpdir()
    cfg = CacheConfig.from_dict(daemon_config(d, lease_s=1))
    server, thread = serve_in_thread(cfg)
    try:
        with DaemonClient(cfg.daemon.socket_path) as c:
            x = torch.ones(64, 512, dtype=torch.bfloat16)
            c.put("a", x)
            c.put("b", x)
            wait_for(lambda: c.prefetch(["a", "b"]) == ["ready", "ready"], what="both pinned")
            s = daemon_stats(cfg.daemon.socket_path)
            assert (s["hits"], s["misses"], s["tiers"]["host"]["hits"]) == (0, 0, 0)
            assert_same(c.get("a"), x)  # takes the prefetch's pin
            s = daemon_stats(cfg.daemon.socket_path)
            assert (s["hits"], s["tiers"]["host"]["hits"], s["daemon"]["prefetch"]["taken"]) == (1, 1, 1)
            wait_for(lambda: daemon_stats(cfg.daemon.socket_path)["daemon"]["prefetch"]["expired"] == 1,
                     timeout=10, what="b's pin to expire")
            assert_same(c.get("b"), x)
            s = daemon_stats(cfg.daemon.socket_path)
            assert (s["hits"], s["misses"], s["tiers"]["host"]["hits"]) == (2, 0, 2)
    finally:
        server.stop()
        thread.join(10)
