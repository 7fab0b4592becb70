"""Crash safety: SIGKILL at chosen points of a write (deterministic), a small random crash campaign
(``tools/crash_campaign.py``, the CI size of the long campaign in ``docs/reliability.md``), and
proof that the campaign's checker catches wrong bytes, resurrected old values, lost entries and
damaged accounting.

Promises under test (``docs/operations.md``, "Crash"): a record's payload is written and synced
before its index entry commits in one LMDB transaction, so after a kill it is wholly there or absent; a put that returned with ``nvme.write_through`` (or
that went to NVMe directly) is served after a restart; older bytes never come back: in write-back
mode an overwrite deletes the older record before it returns, with ``nvme.write_through`` the new
record replaces it in one transaction (a cut overwrite leaves the old value or the new, never a
miss), and a write-through that does not land deletes it before the put returns.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from ectier import TieredCache

from conftest import assert_same, check_quiescent

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import crash_points  # noqa: E402
from tools import crash_campaign as cc  # noqa: E402

# ============================================================================ kill points


def _run_to_point(point: str, store: str) -> None:
    from fork_helpers import forked_python

    proc = forked_python([os.path.join(REPO, "tests", "crash_points.py"), point, store], stdout=True)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.startswith("AT "):
                break
        assert lines[-2:] == ["COMMITTED", f"AT {point}"], (lines, proc.stderr_text())
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert proc.returncode == -signal.SIGKILL
    finally:
        proc.close()


# point -> what a restart may serve for "k" ("v1": the committed old value, "v2": the new one,
# None: a miss); the first element is what LMDB's atomicity makes of it here
EXPECTED = {
    "mid-txn-payload": ["v1"],  # the transaction never committed: exactly the old record
    "after-commit": ["v2"],  # committed in LMDB: the new record, bookkeeping or not
    "mid-delete-txn": ["v1"],  # the delete never committed
    # write-through: the old record stays until the new one replaces it in one transaction
    "wt-between-commit-and-write": ["v1"],
    "wt-mid-txn": ["v1"],
    "wt-returned": ["v2"],  # write_through + sync: a put that returned survives SIGKILL
    # the write-through failed: v2 lived in host memory only, and v1 was deleted before put returned
    "wt-failed-returned": [None],
    # v2 committed, then cut while it was moved below the budget's end: at its old place or its new
    "move-mid-txn": ["v2"],
    "move-after-commit": ["v2"],
}


@pytest.mark.parametrize("point", crash_points.POINTS)
def test_kill_at_a_chosen_point_leaves_old_or_new_never_torn(tmp_path, point):
    store = str(tmp_path / "store")
    _run_to_point(point, store)
    cfg = crash_points.config(point, store)
    with TieredCache(cfg) as cache:
        st = cache.stats()["tiers"]["nvme"]
        assert st["quarantined"] == 0 and st["orphans_reclaimed"] == 0  # nothing torn on disk
        got = cache.get("k")
        values = {"v1": crash_points.V1(point), "v2": crash_points.V2(point), None: None}
        allowed = EXPECTED[point]
        if got is None:
            assert None in allowed, f"{point}: k is a miss, expected {allowed}"
        else:
            matches = [name for name in allowed if name is not None and got.dtype == values[name].dtype
                       and torch.equal(got.view(torch.uint8), values[name].view(torch.uint8))]
            assert matches, f"{point}: k holds bytes that are none of {allowed}"
        assert_same(cache.get("other"), crash_points.V3(point))  # the bystander is untouched
        assert cache.stats()["tiers"]["nvme"]["checksum_failures"] == 0
        check_quiescent(cache)
        if point.startswith("move-"):  # the cut move is done again at open: the file is back within budget
            assert os.path.getsize(os.path.join(store, "segment.0")) <= 1.1 * crash_points.MOVE_CAPACITY


# ============================================================================ the random campaign


def test_small_crash_campaign(tmp_path):
    """30 SIGKILLs over the four variants (write-through, nvme-only, demotion, daemon)."""
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "crash_campaign.py"), "--kills", "30", "--seed", "7",
         "--max-delay-s", "0.3", "--daemon-every", "10", "--workdir", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["ok"] and not r["failures"]
    assert r["kills_survived"] == 30
    assert set(r["kills_by_variant"]) == set(cc.VARIANTS) and r["kills_by_variant"]["daemon"] == 3
    assert r["keys_checked"] == 30 * cc.N_KEYS
    assert r["wrong_bytes"] == 0 and r["lost_committed"] == 0
    assert r["accounting_mismatches"] == 0 and r["quarantined_or_corrupt"] == 0 and r["writer_errors"] == 0
    assert r["ops_cut_by_kill"] > 0  # kills did land in the middle of operations
    assert r["puts_completed"] > 30 and r["hits"] > 0
    assert r["reopen_s"]["max"] < 5


# ============================================================================ the checker can fail


def _state(tmp_path, variant="nvme-only"):
    state = cc.VariantState(variant, tmp_path / variant / "store")
    state.store.parent.mkdir(parents=True)
    journal = state.store.parent / "journal.log"
    state.journals[journal] = 0
    return state, cc.Journal(journal)


def _put(cache, journal, seq, key, *, commit=True):
    journal.line(f"I {seq} {key} {time.monotonic_ns()}")
    cache.put(key, cc.value_for(1, seq))
    if commit:
        journal.line(f"C {seq} {time.monotonic_ns()} 1")


def _verify(state, strict=True):
    cc.parse_journals(state)
    cc.end_pending(state, time.monotonic_ns())
    tally = cc.Tally()
    cc.verify(state, 1, tally, "test", strict_overwrite=strict)
    return tally


def test_checker_passes_an_honest_store(tmp_path):
    state, j = _state(tmp_path)
    with TieredCache(cc.cache_config(state.name, state.store)) as cache:
        _put(cache, j, 1, "k00")
        _put(cache, j, 2, "k00")
        _put(cache, j, 3, "k01", commit=False)  # cut by the "kill": the new value is fine
        j.line(f"D 4 k02 {time.monotonic_ns()}")  # a delete cut before it ran
    t = _verify(state)
    assert (t.wrong_bytes, t.lost_committed, t.accounting_mismatches, t.failures) == (0, 0, 0, [])
    assert t.keys_checked == cc.N_KEYS and t.hits == 2


@pytest.mark.parametrize("fault", ["foreign-bytes", "old-value-back", "committed-lost", "never-put-served",
                                   "cut-overwrite-lost-strict", "cut-overwrite-lost-write-through",
                                   "header-without-payload"])
def test_checker_catches_each_kind_of_failure(tmp_path, fault):
    state, j = _state(tmp_path, "write-through" if fault == "cut-overwrite-lost-write-through" else "nvme-only")
    with TieredCache(cc.cache_config(state.name, state.store)) as cache:
        _put(cache, j, 1, "k00")
        _put(cache, j, 2, "k01")
        _put(cache, j, 3, "k01")
        if fault == "foreign-bytes":
            cache.put("k00", cc.value_for(1, 99))  # bytes no journaled put wrote
        elif fault == "old-value-back":
            cache.put("k01", cc.value_for(1, 2))  # seq 2 was superseded by seq 3
        elif fault == "committed-lost":
            cache.delete("k00")  # behind the journal's back
        elif fault == "never-put-served":
            cache.put("k05", cc.value_for(1, 5))
        elif fault in ("cut-overwrite-lost-strict", "cut-overwrite-lost-write-through"):
            j.line(f"I 4 k00 {time.monotonic_ns()}")  # an overwrite cut by the kill...
            cache.delete("k00")  # ...that left neither the old nor the new value (both variants are strict)
    if fault == "header-without-payload":  # layout v2: its blocks lie past the end of the segment file
        import nvme_helpers as nh

        value = nh.index_value(state.store, "k00", namespace=cc.NAMESPACE)
        nh.set_index_value(state.store, "k00", nh.with_location(value, [(1 << 24, 1)]), namespace=cc.NAMESPACE)
    t = _verify(state, strict=state.name in cc.STRICT_OVERWRITE)
    if fault in ("foreign-bytes", "old-value-back", "never-put-served"):
        assert t.wrong_bytes == 1, t.failures
    elif fault == "header-without-payload":
        assert t.quarantined_or_corrupt == 1 and t.lost_committed == 1, t.failures
    else:
        assert t.lost_committed == 1, t.failures
    assert t.failures


def test_write_back_misses_are_allowed_but_old_bytes_are_not(tmp_path):
    state, j = _state(tmp_path, "demotion")
    with TieredCache(cc.cache_config(state.name, state.store)) as cache:
        j.line(f"I 1 k00 {time.monotonic_ns()}")
        cache.put("k00", cc.value_for(1, 1))
        j.line(f"C 1 {time.monotonic_ns()} 0")  # host only: not durable
    t = _verify(state, strict=False)
    assert t.lost_committed == 0 and t.allowed_misses_write_back == 1


# ============================================================================ daemon killed mid-commit

_STALLING_DAEMON = """
import os, sys, time
from ectier.tiers.nvme import NvmeTier
from ectier.entry import entry_digest
target, marker = entry_digest("test", "K"), sys.argv[2]
original = NvmeTier.write
def write(self, digest, record):
    if digest == target and os.path.exists(marker + ".armed"):
        open(marker, "w").close()  # the commit of K is now inside its write-through
        time.sleep(3600)
    return original(self, digest, record)
NvmeTier.write = write
from ectier.cli import main
main(["serve", "--config", sys.argv[1]], prog_name="stalling-daemon")
"""


def test_daemon_killed_mid_commit_keeps_acknowledged_entries():
    """The daemon is SIGKILLed while it executes a client's commit of K v2 (host commit done, the
    write-through of v2 not done): after a restart every acknowledged entry is served, K is its old
    value (its commit was never acknowledged; the older NVMe record stays until the write-through
    replaces it), and the client got a clean DaemonUnavailableError, not a hang."""
    from daemon_helpers import (DaemonProcess, daemon_config, make_tensor, remove_dir, short_tmpdir,
                                tensor_digest, wait_for, write_config)
    from fork_helpers import forked_python
    from ectier.daemon.client import DaemonClient, DaemonUnavailableError

    d = short_tmpdir()
    proc = restarted = c = None
    try:
        cfg = daemon_config(d, write_through=True)
        path = write_config(os.path.join(d, "cfg.json"), cfg)
        sock = cfg["daemon"]["socket_path"]
        marker = os.path.join(d, "in-commit")
        proc = forked_python(["-c", _STALLING_DAEMON, path, marker])
        c = DaemonClient(sock, connect_retry_s=30, timeout_s=60)
        v1, other = make_tensor(1, "uint8", (300000,)), make_tensor(2, "float16", (100, 77))
        c.put("K", v1)
        c.put("other", other)
        open(marker + ".armed", "w").close()
        r = c.call("reserve", key="K", dtype="float32", shape=[5000])
        box = {}

        def commit():
            try:
                box["reply"] = c.call("commit", retry=False, lease=r["lease"])
            except Exception as exc:  # noqa: BLE001 - checked below
                box["error"] = exc

        import threading

        t = threading.Thread(target=commit)
        t.start()
        wait_for(lambda: os.path.exists(marker), timeout=30, what="the daemon to stall inside the commit")
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        t.join(30)
        assert not t.is_alive() and isinstance(box.get("error"), DaemonUnavailableError), box
        c.close()
        restarted = DaemonProcess(path, sock).start()
        with DaemonClient(sock) as fresh:
            assert tensor_digest(fresh.get("other")) == tensor_digest(other)
            got = fresh.get("K")
            assert got is not None and tensor_digest(got) == tensor_digest(v1)
            st = fresh.stats()["tiers"]["nvme"]
            assert st["quarantined"] == 0 and st["checksum_failures"] == 0
    finally:
        if proc is not None:
            proc.close()
        if c is not None:
            c.close()
        if restarted is not None:
            restarted.stop()
        remove_dir(d)
