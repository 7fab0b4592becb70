"""A damaged LMDB store (issue 16, item 5): ``ectier fsck --path DIR`` reports it, ``--repair``
salvages every intact record into a fresh store (the damaged one moved to ``DIR/damaged-*``), and
``nvme.on_damaged: reset`` lets a cache start with an empty store and one warning.

Damage is done to real stores: both meta pages zeroed (the first two pages of ``data.mdb``), garbage
written over B-tree pages (found by LMDB's page header: page number, flags), a truncated file, a
flipped payload byte. Salvaged records are checked byte-exact through ``TieredCache.get``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import struct
import subprocess
import sys

import pytest

from ectier import StoreDamagedError, StoreOpenError, TieredCache
from ectier.cli import main
from ectier.fsck import check, repair

from click.testing import CliRunner
from conftest import KiB, MiB, assert_same, filled, make_config, open_lmdb
from ectier.tiers.nvme_record import parse_index_value

import nvme_helpers as nh

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = (300, 3000, 40 * KiB)  # inline in a leaf, one overflow page, many overflow pages
N = 60  # enough headers for the meta database to need branch pages
P_BRANCH, P_LEAF = 0x01, 0x02


def _value(i: int):
    return filled(SIZES[i % len(SIZES)], i)


def _build_store(path, codec: str = "raw"):
    cfg = make_config(path, host_bytes=0, nvme_bytes=64 * MiB, codec=codec)
    with TieredCache(cfg) as cache:
        for i in range(N):
            cache.put(f"k{i}", _value(i))
    psize = nh.lmdb_page_bytes(path)
    return cfg, psize


def _pages(data_file, psize, flag):
    """Numbers of the pages in ``data_file`` that carry their own number and ``flag`` (LMDB page header)."""
    raw = data_file.read_bytes()
    out = []
    for pgno in range(2, len(raw) // psize):
        own, _pad, flags = struct.unpack_from("<QHH", raw, pgno * psize)
        if own == pgno and flags & flag:
            out.append(pgno)
    return out


def _overwrite(data_file, psize, pages, rng):
    with open(data_file, "r+b") as f:
        for pgno in pages:
            f.seek(pgno * psize)
            f.write(rng.randbytes(psize))


def zero_meta(path, psize):
    with open(path / "lmdb" / "data.mdb", "r+b") as f:
        f.write(bytes(2 * psize))


def garbage_branches(path, psize, seed=0):
    pages = _pages(path / "lmdb" / "data.mdb", psize, P_BRANCH)
    assert pages, "the test store has no branch pages to damage"
    _overwrite(path / "lmdb" / "data.mdb", psize, pages, random.Random(seed))


def garbage_branches_and_leaves(path, psize, seed=0):
    data = path / "lmdb" / "data.mdb"
    rng = random.Random(seed)
    leaves = _pages(data, psize, P_LEAF)
    _overwrite(data, psize, _pages(data, psize, P_BRANCH) + rng.sample(leaves, max(1, len(leaves) // 4)), rng)


def _served(cfg):
    """key -> value served by a fresh cache on ``cfg`` (misses left out); every hit must be exact."""
    out = {}
    with TieredCache(cfg) as cache:
        for i in range(N):
            got = cache.get(f"k{i}")
            if got is not None:
                assert_same(got, _value(i))
                out[f"k{i}"] = got
        assert cache.stats()["tiers"]["nvme"]["checksum_failures"] == 0
    return out


@pytest.fixture
def runner():
    return CliRunner()


# ============================================================================ open, report, repair


@pytest.mark.parametrize("damage", [zero_meta, garbage_branches], ids=["zeroed-meta", "garbage-branches"])
@pytest.mark.parametrize("codec", ["raw", "zstd-planes"])
def test_damaged_store_is_reported_and_repair_salvages_every_record(tmp_path, runner, damage, codec):
    store = tmp_path / "nvme"
    cfg, psize = _build_store(store, codec)
    created = check(store).settings["created"]
    damage(store, psize)

    with pytest.raises(StoreDamagedError) as exc:  # a StoreOpenError, as before, naming the way out
        TieredCache(cfg)
    assert isinstance(exc.value, StoreOpenError)
    assert "nvme.path" in str(exc.value) and "ectier fsck" in str(exc.value) and "nvme.on_damaged" in str(exc.value)

    result = runner.invoke(main, ["fsck", "--path", str(store), "--json"])
    assert result.exit_code == 1, result.output
    report = json.loads(result.output)
    assert report["damaged"] and report["mode"] == "page-scan" and report["lmdb_error"]
    assert (report["entries"], report["intact"], report["checksum_failed"], report["unreadable"]) == (N, N, 0, 0)

    result = runner.invoke(main, ["fsck", "--path", str(store), "--repair"])
    assert result.exit_code == 0, result.output
    assert "repaired" in result.output and f"{N} records" in result.output
    assert len(_served(cfg)) == N  # every record back, byte-exact
    after = check(store)
    assert not after.damaged and after.mode == "lmdb" and after.intact == N
    assert after.settings["created"] == created and "repaired" in after.settings
    assert [os.path.basename(d) for d in after.damaged_copies] == [p.name for p in store.glob("damaged-*")]
    assert len(after.damaged_copies) == 1
    assert check(after.damaged_copies[0]).intact == N  # the moved copy is a store directory fsck reads


def test_garbage_in_branch_and_leaf_pages_salvages_what_survived(tmp_path):
    store = tmp_path / "nvme"
    cfg, psize = _build_store(store)
    garbage_branches_and_leaves(store, psize, seed=3)
    with pytest.raises(StoreDamagedError):
        TieredCache(cfg)
    report = check(store)
    assert report.damaged and report.mode == "page-scan" and report.damaged_pages > 0
    assert 0 < report.intact <= report.entries <= N
    result = repair(store)
    assert result.repaired and result.salvaged == report.intact and result.lost == report.entries - report.intact
    served = _served(cfg)  # no wrong bytes: every hit exact (checked inside), the rest misses
    assert len(served) == result.salvaged


def test_a_record_failing_its_checksum_is_reported_and_dropped_by_repair(tmp_path, runner):
    store = tmp_path / "nvme"
    cfg, _ = _build_store(store)
    nh.flip_payload_byte(store, nh.index_value(store, "k4"), bit=0x40)
    # a header whose payload is not there: its blocks lie past the end of the segment file
    nh.set_index_value(store, "k7", nh.with_location(nh.index_value(store, "k7"), [(1 << 20, 1)]))
    # a reused extent: k9's index entry names k10's blocks (k10 is newer: k9 is the one reported)
    k10 = nh.index_value(store, "k10")
    nh.set_index_value(store, "k9", nh.with_location(nh.index_value(store, "k9"), parse_index_value(k10)[1].extents))
    result = runner.invoke(main, ["fsck", "--path", str(store)])
    assert result.exit_code == 1
    assert "test/k4" in result.output and "checksum" in result.output and "test/k7" in result.output
    assert "test/k9" in result.output and "reused extent" in result.output
    report = check(store)
    assert report.mode == "lmdb" and report.lmdb_error is None
    assert (report.entries, report.intact, report.checksum_failed, report.unreadable) == (N, N - 3, 2, 1)
    res = repair(store)
    assert res.repaired and res.salvaged == N - 3 and res.lost == 3
    served = _served(cfg)
    assert set(served) == {f"k{i}" for i in range(N)} - {"k4", "k7", "k9"}


def test_healthy_store_passes_and_repair_changes_nothing(tmp_path, runner):
    store = tmp_path / "nvme"
    cfg, _ = _build_store(store)
    before = (store / "lmdb" / "data.mdb").read_bytes()
    result = runner.invoke(main, ["fsck", "--path", str(store)])
    assert result.exit_code == 0, result.output
    assert "healthy" in result.output
    result = runner.invoke(main, ["fsck", "--path", str(store), "--repair", "--json"])
    assert result.exit_code == 0
    out = json.loads(result.output)
    assert out["repaired"] is False and out["report"]["intact"] == N and out["moved_to"] is None
    assert (store / "lmdb" / "data.mdb").read_bytes() == before and not list(store.glob("damaged-*"))
    assert len(_served(cfg)) == N


def test_fsck_refuses_a_store_in_use_and_a_directory_that_is_no_store(tmp_path, runner):
    store = tmp_path / "nvme"
    cfg, _ = _build_store(store)
    with TieredCache(cfg):
        result = runner.invoke(main, ["fsck", "--path", str(store)])
        assert result.exit_code == 2 and "in use" in result.output, result.output
        result = runner.invoke(main, ["fsck", "--path", str(store), "--repair"])
        assert result.exit_code == 2 and "in use" in result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    result = runner.invoke(main, ["fsck", "--path", str(empty)])
    assert result.exit_code == 2 and "not an ectier store" in result.output
    assert not (empty / "lmdb").exists()


_TRUNCATED = """
import os, sys
data = os.path.join(sys.argv[1], "lmdb", "data.mdb")
os.truncate(data, os.path.getsize(data) * 2 // 3)
"""


def test_truncated_store_is_reported_and_repaired_in_a_child(tmp_path):
    """A truncated data.mdb would SIGBUS a reader of its missing pages: fsck runs in a child here."""
    store = tmp_path / "nvme"
    cfg, _ = _build_store(store)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", _TRUNCATED, str(store)], check=True, env=env)
    cli = [sys.executable, "-m", "ectier.cli", "fsck", "--path", str(store), "--json"]
    proc = subprocess.run(cli, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert "truncated" in report["lmdb_error"] and report["mode"] == "page-scan" and report["intact"] > 0
    proc = subprocess.run(cli + ["--repair"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["salvaged"] == report["intact"]
    assert len(_served(cfg)) == report["intact"]


# ============================================================================ nvme.on_damaged


def test_on_damaged_reset_starts_fresh_with_one_warning(tmp_path, caplog):
    store = tmp_path / "nvme"
    cfg, psize = _build_store(store)
    zero_meta(store, psize)
    reset = make_config(store, host_bytes=0, nvme_bytes=64 * MiB, on_damaged="reset")
    with caplog.at_level(logging.WARNING, logger="ectier"):
        cache = TieredCache(reset)
    try:
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        moved = list(store.glob("damaged-*"))
        assert len(moved) == 1
        text = warnings[0].getMessage()
        assert "damaged" in text and "nvme.on_damaged" in text and str(moved[0]) in text and "ectier fsck" in text
        assert len(cache) == 0 and cache.get("k0") is None
        assert cache.stats()["tiers"]["nvme"]["damaged_resets"] == 1
        cache.put("new", filled(3000, 1))
        assert_same(cache.get("new"), filled(3000, 1))
    finally:
        cache.close()
    with TieredCache(cfg) as again:  # the fresh store is a normal store now, even with on_damaged=fail
        assert_same(again.get("new"), filled(3000, 1))
    assert check(moved[0]).intact == N  # nothing was thrown away: the damaged copy can still be read


def test_on_damaged_reset_leaves_a_store_that_is_not_damaged_alone(tmp_path):
    store = tmp_path / "nvme"
    cfg, _ = _build_store(store)
    env, _m, _d, _q, settings = open_lmdb(store)
    try:
        with env.begin(write=True) as txn:
            txn.put(b"format", b"99", db=settings)
    finally:
        env.close()
    reset = make_config(store, host_bytes=0, nvme_bytes=64 * MiB, on_damaged="reset")
    with pytest.raises(StoreOpenError, match="format") as exc:
        TieredCache(reset)
    assert not isinstance(exc.value, StoreDamagedError)
    assert not list(store.glob("damaged-*"))


def test_on_damaged_is_a_checked_config_field():
    from ectier import CacheConfig, ConfigError
    from ectier.config import NvmeTierConfig

    assert NvmeTierConfig().on_damaged == "fail"
    with pytest.raises(ConfigError, match="nvme.on_damaged"):
        NvmeTierConfig(on_damaged="ignore")
    assert CacheConfig.from_env({"ECTIER_NVME__PATH": "/nvme/ec", "ECTIER_NVME__ON_DAMAGED": "reset"}).nvme.on_damaged == "reset"


_NEVER_ABORTS = r"""
import random, shutil, sys
from ectier import StoreDamagedError, TieredCache
from ectier.config import CacheConfig
from ectier.fsck import check
src, work, seed, trials = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
cfg = CacheConfig.from_dict({"host": {"capacity_bytes": 0},
                             "nvme": {"path": work, "capacity_bytes": 64 << 20, "sync": False}})
rng = random.Random(seed)
size = __import__("os").path.getsize(src + "/lmdb/data.mdb")
counts = {"opened": 0, "damaged": 0}
for t in range(trials):
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(src, work)
    off, n = rng.randrange(8192, size), rng.choice((16, 700, 1342, 4096, 10665))
    with open(work + "/lmdb/data.mdb", "r+b") as f:
        f.seek(off)
        f.write(bytes(n) if rng.random() < 0.5 else rng.randbytes(n))
    check(work)  # ectier fsck: reports, never aborts
    try:
        with TieredCache(cfg) as cache:
            for i in range(60):
                cache.get(f"k{i}")  # served byte-exact or a miss (the parent checks no bytes here)
            for i in range(0, 60, 7):  # writes: LMDB's page allocator takes pages off the free lists
                cache.put(f"k{i}", __import__("torch").full((3000 * (i % 4),), i, dtype=__import__("torch").uint8))
                cache.delete(f"k{i + 1}")
        counts["opened"] += 1
    except StoreDamagedError:
        counts["damaged"] += 1
print(counts["opened"], counts["damaged"])
"""


def test_damage_anywhere_in_the_lmdb_file_never_aborts_the_process(tmp_path):
    """Zeroed or random runs at random places of data.mdb (60 stores): opening the cache either
    works (and then serves, writes and deletes) or raises StoreDamagedError, and fsck reports;
    LMDB never gets to walk a malformed page (it asserts and aborts the process: SIGABRT, seen
    before the pages were checked at open)."""
    store = tmp_path / "nvme"
    _build_store(store)
    r = subprocess.run([sys.executable, "-c", _NEVER_ABORTS, str(store), str(tmp_path / "work"), "7", "60"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stderr[-2000:]}"
    opened, damaged = map(int, r.stdout.split())
    assert opened + damaged == 60 and damaged > 0, r.stdout


def test_fsck_names_a_killed_repairs_staging_and_payloads_no_key_can_be_matched_to(tmp_path, runner):
    """A data.mdb cut to its meta pages leaves no index entry: fsck said '0 lost' with the payloads
    still in segment.0; and a killed --repair's staging directory went unmentioned."""
    store = tmp_path / "nvme"
    _build_store(store)
    os.truncate(store / "lmdb" / "data.mdb", 8192)
    (store / ".repair-20261207T000000Z-1").mkdir()
    result = runner.invoke(main, ["fsck", "--path", str(store)])
    assert result.exit_code == 1, result.output
    assert "left by a repair that was killed" in result.output and ".repair-20261207T000000Z-1" in result.output
    assert "no index entry was found" in result.output and "cannot be salvaged" in result.output
    report = check(store)
    assert report.entries == 0 and report.segment_bytes > 0 and len(report.stale_repairs) == 1
    result = runner.invoke(main, ["fsck", "--path", str(store), "--repair"])
    assert result.exit_code == 0 and "cannot be salvaged" in result.output, result.output
    assert not list(store.glob(".repair-*"))


def test_repair_of_a_healthy_store_removes_a_killed_repairs_staging_as_fsck_says(tmp_path, runner):
    """A repair killed after its swap leaves a healthy store and its staging directory; fsck said
    'the next --repair removes it', and --repair answered 'nothing to repair' and kept it."""
    store = tmp_path / "nvme"
    _build_store(store)
    stale = store / ".repair-20261207T000000Z-1"
    (stale / "lmdb").mkdir(parents=True)
    result = runner.invoke(main, ["fsck", "--path", str(store)])
    assert result.exit_code == 0 and "the next --repair removes it" in result.output, result.output
    result = runner.invoke(main, ["fsck", "--path", str(store), "--repair"])
    assert result.exit_code == 0 and "nothing to repair" in result.output, result.output
    assert "(removed)" in result.output and not stale.exists(), result.output
    assert repair(store).removed_stale == [] and check(store).stale_repairs == []
    stale.mkdir()
    assert repair(store).removed_stale == [str(stale)] and not stale.exists()


def test_a_file_ending_before_lmdbs_last_page_number_is_not_damage(tmp_path, runner):
    """Pages allocated and freed in one transaction are never written, so a healthy data.mdb can
    end before LMDB's last page number (found by review: such a store was called truncated)."""
    import lmdb

    store = tmp_path / "nvme"
    cfg, _ = _build_store(store)
    env = lmdb.open(str(store / "lmdb"), max_dbs=4)
    try:
        scratch = env.open_db(b"review-scratch")
        with env.begin(write=True) as txn:  # overflow values put and deleted in the same transaction
            txn.put(b"x" * 100, b"\1" * 40000, db=scratch)
            txn.put(b"y" * 32, b"\1" * 50000, db=scratch)
            txn.delete(b"x" * 100, db=scratch)
            txn.delete(b"y" * 32, db=scratch)
        psize, last = env.stat()["psize"], env.info()["last_pgno"]
    finally:
        env.close()
    assert (store / "lmdb" / "data.mdb").stat().st_size < (last + 1) * psize  # the case at hand
    assert len(_served(cfg)) == N  # opens, every record served
    result = runner.invoke(main, ["fsck", "--path", str(store)])
    assert result.exit_code == 0 and "healthy" in result.output, result.output


def _free_list_entry(data: bytes, psize: int) -> tuple[int, int]:
    """(offset of the first page number of an inline free-page list, the main tree's root page):
    LMDB 0.9, 64-bit; the newer meta page's free-database root is a leaf here (a small store)."""
    metas = [struct.unpack_from("<QQ", data, n * psize + 16 + 24 + 2 * 48) for n in (0, 1)]  # last_pg, txnid
    meta = (0 if metas[0][1] >= metas[1][1] else 1) * psize
    free_root = struct.unpack_from("<Q", data, meta + 16 + 24 + 40)[0]
    main_root = struct.unpack_from("<Q", data, meta + 16 + 24 + 48 + 40)[0]
    page = free_root * psize
    assert struct.unpack_from("<H", data, page + 10)[0] & P_LEAF, "the free database's root is no leaf"
    off = page + struct.unpack_from("<H", data, page + 16)[0]  # the first node
    lo, hi, flags, ksize = struct.unpack_from("<HHHH", data, off)
    assert not flags & 0x01 and (lo | hi << 16) >= 16, "no inline free-page list"
    return off + 8 + ksize + 8, main_root  # past the node header, the key (a txnid) and the count


def test_a_free_page_list_naming_a_live_page_is_damage_not_a_later_corruption(tmp_path):
    """LMDB's page allocator hands out what the free-page lists name, trusting them: a list that
    names a live page would have the next write overwrite it. Found at open, before any write."""
    store = tmp_path / "nvme"
    cfg, psize = _build_store(store)
    with TieredCache(cfg) as cache:  # deletes: pages go onto the free lists
        for i in range(0, N, 2):
            cache.delete(f"k{i}")
    data_file = store / "lmdb" / "data.mdb"
    first_id, live = _free_list_entry(data_file.read_bytes(), psize)
    with open(data_file, "r+b") as f:
        f.seek(first_id)
        f.write(struct.pack("<Q", live))
    with pytest.raises(StoreDamagedError, match="listed free but is live"):
        TieredCache(cfg)
    assert check(store).damaged


def test_a_page_scan_repair_does_not_call_unfound_records_zero_lost(tmp_path, runner):
    """After garbage over pages, the records whose index entries were there are not found at all:
    the repair line said '0 lost' (newcomer run, 2026-12-07); it now says a page scan cannot count them."""
    store = tmp_path / "nvme"
    _, psize = _build_store(store)
    garbage_branches_and_leaves(store, psize, seed=3)
    r = runner.invoke(main, ["fsck", "--path", str(store), "--repair"])
    assert r.exit_code == 0, r.output
    assert "a page scan cannot count those" in " ".join(r.output.split()) and ", 0 lost;" not in r.output, r.output


def test_a_header_claiming_petabytes_is_reported_not_allocated(tmp_path, runner):
    """A zstd record whose header claims 16 PiB of raw bytes (its checksum intact): fsck reports it
    (the frame declares another size) and repair drops it; fsck decodes with bounded memory, never
    a full-size buffer (a ``MemoryError`` traceback before)."""
    import dataclasses

    from ectier.tiers.nvme_record import pack_index_value

    store = tmp_path / "nvme"
    _build_store(store, codec="zstd")
    header, loc = parse_index_value(nh.index_value(store, "k5"))
    huge = dataclasses.replace(header, shape=(1 << 53,), raw_nbytes=1 << 53)
    nh.set_index_value(store, "k5", pack_index_value(huge, loc))
    result = runner.invoke(main, ["fsck", "--path", str(store)])
    assert result.exit_code == 1 and "test/k5" in result.output and "zstd payload declares" in result.output
    res = repair(store)
    assert res.repaired and res.salvaged == N - 1 and res.lost == 1


def test_a_store_of_a_newer_format_is_not_called_healthy(tmp_path, runner):
    """A store whose ``settings`` name format 3 (a newer ectier's): the cache refuses to open it,
    and fsck cannot vouch for records of a layout it does not know — exit 2 naming the format
    (it said "healthy", exit 0), for ``--repair`` too, and nothing changes."""
    store = tmp_path / "nvme"
    _build_store(store)
    env, *_, settings = open_lmdb(store)
    with env.begin(write=True) as txn:
        txn.put(b"format", b"3", db=settings)
    env.close()
    before = (store / "lmdb" / "data.mdb").read_bytes()
    for args in ([], ["--repair"]):
        result = runner.invoke(main, ["fsck", "--path", str(store), *args])
        assert result.exit_code == 2 and "format 3" in result.output, result.output
    assert (store / "lmdb" / "data.mdb").read_bytes() == before and not list(store.glob("damaged-*"))
