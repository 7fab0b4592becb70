"""``ectier fsck --repair`` SIGKILLed at each point of its work (``tests/repair_kill.py``), then the
store opened, checked or repaired again: nothing of the rebuilt store is ever lost.

Before the swap was journaled (``ectier/tiers/repairswap.py``), a kill between the swap's renames
left a new index without its segment (the next open quarantined every record, and the next repair
then called the store healthy and deleted the staging directory holding the rebuilt segment), or an
old segment without its index ("lost its index": open and repair refused, pointing at
``damaged-*``). Now a kill before the journal leaves the damaged store byte for byte as it was, and
a kill after it is finished by whatever takes the store's lock next: every salvaged record is served
byte-exact, the damaged store is whole in one ``damaged-*`` directory, nothing else is left.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
from pathlib import Path

import pytest
from click.testing import CliRunner

from ectier import StoreDamagedError, StoreOpenError, TieredCache
from ectier.cli import main
from ectier.fsck import check, repair

from conftest import KiB, MiB, assert_same, filled, make_config
from nvme_helpers import lmdb_page_bytes
from repair_kill import POINTS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 40
SIZES = (300, 3000, 40 * KiB, 200 * KiB)  # inline in a leaf, overflow pages, several segment blocks
STORE_FILES = ("lmdb/data.mdb", "segment.0")


def _value(i: int):
    return filled(SIZES[i % len(SIZES)], i)


def _cfg(path: Path):
    return make_config(path, host_bytes=0, nvme_bytes=64 * MiB)


def _damaged_store(path: Path) -> dict[str, str]:
    """A store of N records with both meta pages zeroed (a page-scan repair finds every record);
    returns the sha256 of its files."""
    with TieredCache(_cfg(path)) as cache:
        for i in range(N):
            cache.put(f"k{i}", _value(i))
    psize = lmdb_page_bytes(path)
    with open(path / "lmdb" / "data.mdb", "r+b") as f:
        f.write(bytes(2 * psize))
    return _hashes(path)


def _hashes(path: Path) -> dict[str, str]:
    return {name: hashlib.sha256((path / name).read_bytes()).hexdigest() for name in STORE_FILES}


def _kill_at(point: str, store: Path) -> None:
    from fork_helpers import forked_python

    proc = forked_python([os.path.join(REPO, "tests", "repair_kill.py"), point, str(store)], stdout=True)
    try:
        proc.wait(120)
        assert proc.returncode == -signal.SIGKILL, (point, proc.stdout.read(), proc.stderr_text()[-3000:])
    finally:
        proc.close()


def _served(store: Path) -> int:
    """How many of the N records a cache on ``store`` serves; every one served must be byte-exact."""
    with TieredCache(_cfg(store)) as cache:
        served = 0
        for i in range(N):
            got = cache.get(f"k{i}")
            if got is not None:
                assert_same(got, _value(i))
                served += 1
        assert cache.stats()["tiers"]["nvme"]["quarantined"] == 0
    return served


def _assert_repaired(store: Path, damaged_hashes: dict[str, str]) -> None:
    """Every record served byte-exact, the damaged store whole in its one ``damaged-*``
    directory, nothing else left in the store directory."""
    assert _served(store) == N
    copies = sorted(p.name for p in store.glob("damaged-*"))
    assert sorted(p.name for p in store.iterdir()) == sorted(["ectier.lock", "lmdb", "segment.0", *copies])
    assert len(copies) == 1, copies
    assert _hashes(store / copies[0]) == damaged_hashes  # the damaged store, byte for byte
    report = check(store)
    assert not report.damaged and report.intact == N and report.stale_repairs == [] and report.finished_swap is None


def _next_check(store: Path) -> None:
    result = CliRunner().invoke(main, ["fsck", "--path", str(store)])
    assert result.exit_code == 0, result.output
    assert "finished first" in result.output and "damaged-" in result.output, result.output


def _next_open(store: Path) -> None:
    assert _served(store) == N  # (the open finishes the swap; _assert_repaired opens again)


def _next_repair(store: Path) -> None:
    result = repair(store)
    assert not result.repaired and result.removed_stale == [], result  # nothing to repair: it was finished
    assert result.report.finished_swap is not None and not result.report.damaged and result.report.intact == N


BEFORE_SWAP = ("building", "journal-unrenamed")  # the damaged store untouched yet


@pytest.mark.parametrize("point", [p for p in POINTS if p not in BEFORE_SWAP])
def test_a_repair_killed_during_its_swap_is_finished_by_the_next_check_open_or_repair(tmp_path, point):
    killed = tmp_path / "killed"
    damaged_hashes = _damaged_store(killed)
    _kill_at(point, killed)
    for then in (_next_check, _next_open, _next_repair):
        store = tmp_path / then.__name__
        shutil.copytree(killed, store, symlinks=True)  # (the journal names paths relative to the store)
        then(store)
        _assert_repaired(store, damaged_hashes)


@pytest.mark.parametrize("point", BEFORE_SWAP)
def test_a_repair_killed_before_its_swap_leaves_the_damaged_store_as_it_was(tmp_path, point):
    """Killed while building the fresh store, or with the journal written but not yet renamed
    into place: the next check (which removes an unrenamed journal) and repair start over."""
    store = tmp_path / "nvme"
    damaged_hashes = _damaged_store(store)
    _kill_at(point, store)
    assert _hashes(store) == damaged_hashes and not list(store.glob("damaged-*"))
    assert (store / "repair-swap.json.tmp").exists() == (point == "journal-unrenamed")
    assert not (store / "repair-swap.json").exists()
    staging = [str(p) for p in store.glob(".repair-*")]
    assert len(staging) == 1
    with pytest.raises(StoreDamagedError):
        TieredCache(_cfg(store))
    report = check(store)
    assert report.damaged and report.intact == N and report.stale_repairs == staging and report.finished_swap is None
    result = repair(store)
    assert result.repaired and result.salvaged == N and result.removed_stale == staging
    _assert_repaired(store, damaged_hashes)


def test_a_swap_that_cannot_be_finished_is_refused_and_nothing_is_removed(tmp_path):
    """The rebuilt segment deleted by hand after a kill: the open and fsck refuse, naming the
    journal, the damaged and rebuilt stores and the command; the staging directory is kept."""
    store = tmp_path / "nvme"
    damaged_hashes = _damaged_store(store)
    _kill_at("journal-written", store)
    (staging,) = store.glob(".repair-*")
    (staging / "segment.0").unlink()
    for attempt in (lambda: TieredCache(_cfg(store)), lambda: check(store), lambda: repair(store)):
        with pytest.raises(StoreOpenError) as exc:
            attempt()
        message = str(exc.value)
        assert "repair-swap.json" in message and "damaged-" in message and staging.name in message, message
        assert "segment.0" in message and "ectier fsck --path" in message, message
        assert _hashes(store) == damaged_hashes and (staging / "lmdb").is_dir() and (store / "repair-swap.json").exists()
    result = CliRunner().invoke(main, ["fsck", "--path", str(store)])
    assert result.exit_code == 2 and "cannot finish the swap" in result.output, result.output


def test_a_journal_ectier_did_not_write_is_refused(tmp_path):
    store = tmp_path / "nvme"
    with TieredCache(_cfg(store)) as cache:
        cache.put("k0", _value(0))
    (store / "repair-swap.json").write_text('{"staging": "../elsewhere", "damaged": "damaged-x", "old": [], "new": ["lmdb"]}')
    for attempt in (lambda: TieredCache(_cfg(store)), lambda: check(store)):
        with pytest.raises(StoreOpenError, match="is not one ectier wrote"):
            attempt()
    assert sorted(p.name for p in store.iterdir()) == ["ectier.lock", "lmdb", "repair-swap.json", "segment.0"]
