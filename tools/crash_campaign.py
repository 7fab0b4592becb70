"""Crash campaign: SIGKILL writers (and the daemon) at random moments, reopen the store, check every key.

::

    python tools/crash_campaign.py --kills 1000 --seed 1 --workdir /tmp/cc --json cc.json
    python -m tools.crash_campaign --kills 30 --max-delay-s 0.3        # the CI size (tests/test_crash_campaign.py)

Each kill is one *round* of one variant (rotating; each variant keeps its own store and journals
for the whole campaign, so damage would accumulate):

==================  =================================================================================
variant             what writes, what is promised for a put that returned ("committed")
==================  =================================================================================
``write-through``   a TieredCache with a 512 KiB host tier, ``nvme.write_through`` and ``nvme.sync``:
                    every committed put is durable; an interrupted overwrite leaves the old or the
                    new value (the older record stays until the new one replaces it, one transaction)
``nvme-only``       host tier off: every put goes straight to NVMe (one LMDB transaction); committed
                    puts are durable and an interrupted overwrite leaves exactly the old or the new
``demotion``        write-back (``zstd-planes`` codec): entries reach NVMe when the host evicts them;
                    host-only entries may be lost (a cache), entries larger than the host go to NVMe
                    at once and are durable; no kind of put may ever bring back older bytes
``daemon``          ``ectier serve`` (``python -m ectier.daemon``, write-through) with two client
                    processes putting overlapping keys; the daemon is SIGKILLed (mid-put, mid-commit)
                    and so are the clients (sometimes a client first)
==================  =================================================================================

The writers are forked from this (supervisor) process, which has torch imported and holds no
store open at the fork. A writer appends to its own journal and ``fsync``s every line:

- ``I <seq> <key> <t_ns>`` before a put starts (intent), ``C <seq> <t_ns> <durable>`` after it returned;
- ``D <seq> <key> <t_ns>`` before a delete, ``E <seq> <t_ns>`` after it returned.

``t_ns`` is ``CLOCK_MONOTONIC`` (one clock for every process of the machine). The bytes of a put
follow from ``(campaign seed, seq)`` (:func:`value_for`), so no payload is stored in the journal.

After each kill the supervisor reopens the store (``TieredCache``, timed) and checks, for every key
of the key space, the linearizability of the single-key history against what ``get`` returns:

- an operation X is *still possible* unless some operation Y on the same key completed and had
  started after X ended (an op cut by the kill ends at the kill);
- ``get`` must return the exact bytes, dtype and shape of a still-possible put, else **wrong bytes**
  (this covers torn entries, mixes of two values, and old values coming back);
- a miss is allowed only if the key has no completed operation, or a still-possible operation is a
  delete, a non-durable put (write-back host-only), or (in ``demotion`` only, write-back) a put cut
  by the kill; otherwise it is a **lost committed entry** (so in ``write-through``, ``nvme-only``
  and ``daemon`` an overwrite cut by the kill must leave the old value or the new one);
- the index agrees with the store (layout v2): ``stats`` ``used_bytes`` equals the bytes of the
  index entries' headers plus their payload blocks, ``entries`` equals the number of index entries,
  every entry's blocks lie inside the segment file and no two entries share a block, the blocks in
  use are exactly those the index names (orphaned payload space of a cut write reclaimed), nothing
  is quarantined, no read fails its checksum.

The report (``--json``, also printed) has kills survived, keys checked, wrong bytes, lost committed
entries, accounting mismatches, writer errors and reopen times (p50, p99, max). Exit code 1 when any
of the must-be-zero figures is not zero.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from ectier import testing

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python tools/crash_campaign.py` from anywhere
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from ectier import CacheConfig, HostTierConfig, NvmeTierConfig, TieredCache  # noqa: E402
from ectier.errors import CorruptRecordError  # noqa: E402
from ectier.record import header_nbytes  # noqa: E402
from ectier.tiers.nvme_record import parse_index_value  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
NAMESPACE = "crash"
N_KEYS = 24
KEYS = [f"k{i:02d}" for i in range(N_KEYS)]
HOST_BYTES = 512 * KiB
DTYPES = [("uint8", 1), ("bfloat16", 2), ("float32", 4), ("int64", 8)]
VARIANTS = ("write-through", "nvme-only", "demotion", "daemon")
# variants where an overwrite cut by the kill must leave the old value or the new one, never a miss:
# every committed put is durable (nvme-only: one transaction; write-through: the older record stays
# until the new one replaces it in one transaction)
STRICT_OVERWRITE = ("write-through", "nvme-only", "daemon")
SEQ_STRIDE = 1_000_000  # seq numbers of round r, writer w: r * SEQ_STRIDE + w * SEQ_STRIDE // 2 + i


# ============================================================================ values and configs


def value_spec(seed: int, seq: int) -> tuple[str, tuple[int, ...], np.random.Generator]:
    rng = np.random.default_rng([seed, seq])
    r = rng.random()
    if r < 0.02:
        size = 0
    elif r < 0.12:
        size = int(rng.integers(HOST_BYTES + 8 * KiB, HOST_BYTES + 200 * KiB))  # larger than the host
    else:
        size = int(rng.integers(1, 64 * KiB))
    dtype, itemsize = DTYPES[int(rng.integers(len(DTYPES)))]
    n = size // itemsize if size else 0
    if size and n == 0:
        n = 1
    shape = (n // 16, 16) if n and n % 16 == 0 else ((0, 16) if n == 0 else (n,))
    return dtype, shape, rng


def value_for(seed: int, seq: int) -> torch.Tensor:
    """The tensor put by operation ``seq`` of a campaign with ``seed`` (deterministic)."""
    dtype, shape, rng = value_spec(seed, seq)
    dt = getattr(torch, dtype)
    n = int(np.prod(shape))
    if n == 0:
        return torch.empty(shape, dtype=dt)
    itemsize = torch.empty((), dtype=dt).element_size()
    raw = bytearray(rng.bytes(n * itemsize))
    return torch.frombuffer(raw, dtype=torch.uint8).view(dt).reshape(shape)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def cache_config(variant: str, store: Path, *, host: bool = True) -> CacheConfig:
    write_through = variant in ("write-through", "daemon")
    host_bytes = 0 if variant == "nvme-only" or not host else (2 * MiB if variant == "daemon" else HOST_BYTES)
    return CacheConfig(
        namespace=NAMESPACE,
        host=HostTierConfig(capacity_bytes=host_bytes, block_bytes=16 * KiB, pin_memory=False, admit_wait_s=0.5),
        nvme=NvmeTierConfig(path=str(store), capacity_bytes=64 * MiB, sync=variant == "write-through",
                            write_through=write_through, flush_on_close=False,
                            codec="zstd-planes" if variant == "demotion" else "raw",
                            map_initial_bytes=1 * MiB),
    )


def daemon_config_dict(store: Path, run_dir: str) -> dict[str, Any]:
    cfg = cache_config("daemon", store).to_dict()
    cfg["daemon"] = {"socket_path": os.path.join(run_dir, "d.sock"), "shm_dir": run_dir, "lease_s": 10.0}
    return cfg


# ============================================================================ writers (forked)


class Journal:
    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def line(self, text: str) -> None:
        os.write(self.fd, (text + "\n").encode())
        os.fsync(self.fd)


def _writer_loop(target, journal: Journal, seed: int, start_seq: int, rng: random.Random, durable_of) -> None:
    seq = start_seq
    while True:
        key = rng.choice(KEYS)
        if rng.random() < 0.06:
            journal.line(f"D {seq} {key} {time.monotonic_ns()}")
            target.delete(key)
            journal.line(f"E {seq} {time.monotonic_ns()}")
        else:
            t = value_for(seed, seq)
            durable = durable_of(t)
            journal.line(f"I {seq} {key} {time.monotonic_ns()}")
            target.put(key, t)
            journal.line(f"C {seq} {time.monotonic_ns()} {int(durable)}")
        seq += 1


def _cache_writer(variant: str, store: Path, journal_path: Path, seed: int, start_seq: int) -> None:
    journal = Journal(journal_path)
    cache = TieredCache(cache_config(variant, store))
    cfg = cache.config

    def durable_of(t: torch.Tensor) -> bool:
        if cfg.nvme.write_through or testing.tier(cache, "host") is None:
            return True
        return not testing.tier(cache, "host").fits(t.numel() * t.element_size())  # goes to NVMe directly

    _writer_loop(cache, journal, seed, start_seq, random.Random(seed * 7919 + start_seq), durable_of)


def _daemon_client_writer(socket_path: str, journal_path: Path, seed: int, start_seq: int) -> None:
    from ectier.daemon.client import DaemonClient

    journal = Journal(journal_path)
    client = DaemonClient(socket_path, client_name=f"crash-{start_seq}", timeout_s=10, connect_retry_s=0.2)
    try:
        _writer_loop(client, journal, seed, start_seq, random.Random(seed * 7919 + start_seq), lambda t: True)
    except Exception:  # the daemon died under us: a client-side error is expected, not a failure
        os._exit(0)


def fork_writer(fn, *args) -> int:
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            fn(*args)
        except BaseException:  # noqa: BLE001 - reported through the exit code and stderr
            import traceback

            traceback.print_exc()
            code = 3
        finally:
            os._exit(code)
    return pid


def kill_and_reap(pid: int) -> int:
    """SIGKILL ``pid`` (if still running) and reap it; returns its wait status."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _, status = os.waitpid(pid, 0)
    return status


# ============================================================================ the checker


@dataclass
class Op:
    seq: int
    kind: str  # "put" | "delete"
    key: str
    start: int
    end: int | None = None  # None: not ended yet (only while its writer may still run)
    completed: bool = False
    durable: bool = True


@dataclass
class VariantState:
    name: str
    store: Path
    journals: dict[Path, int] = field(default_factory=dict)  # journal -> bytes parsed
    ops: dict[str, list[Op]] = field(default_factory=dict)  # key -> still-possible ops
    pending: dict[int, Op] = field(default_factory=dict)  # seq -> op without an end
    just_cut: set[int] = field(default_factory=set)  # seqs cut by the latest kill


def parse_journals(state: VariantState) -> None:
    """Read new complete lines of every journal; drop a torn last line (a kill mid-write)."""
    for path, offset in list(state.journals.items()):
        if not path.exists():
            continue
        data = path.read_bytes()[offset:]
        cut = data.rfind(b"\n") + 1
        for line in data[:cut].decode().splitlines():
            parts = line.split()
            tag = parts[0]
            if tag in ("I", "D"):
                op = Op(int(parts[1]), "put" if tag == "I" else "delete", parts[2], int(parts[3]))
                state.pending[op.seq] = op
                state.ops.setdefault(op.key, []).append(op)
            elif tag in ("C", "E"):
                op = state.pending.pop(int(parts[1]))
                op.end, op.completed = int(parts[2]), True
                if tag == "C":
                    op.durable = parts[3] == "1"
            else:
                raise ValueError(f"{path}: unreadable journal line {line!r}")
        if cut < len(data):  # a torn line: cut it so the next writer starts on a line boundary
            os.truncate(path, offset + cut)
        state.journals[path] = offset + cut


def end_pending(state: VariantState, t_kill: int) -> int:
    """Operations cut by the kill end at the kill. Returns how many there were."""
    n = len(state.pending)
    for op in state.pending.values():
        op.end = t_kill
    state.just_cut = set(state.pending)
    state.pending.clear()
    return n


def possible_ops(ops: list[Op]) -> list[Op]:
    """Ops of one key that may still be the key's last effect: no op that completed started after it ended."""
    done_starts = [y.start for y in ops if y.completed]
    latest_done_start = max(done_starts) if done_starts else None
    return [x for x in ops if latest_done_start is None or not (latest_done_start > x.end)]


@dataclass
class Tally:
    rounds: int = 0
    kills: dict[str, int] = field(default_factory=dict)
    keys_checked: int = 0
    hits: int = 0
    misses: int = 0
    wrong_bytes: int = 0
    lost_committed: int = 0
    accounting_mismatches: int = 0
    quarantined_or_corrupt: int = 0
    writer_errors: int = 0
    ops_journaled: int = 0
    puts_completed: int = 0
    cut_by_kill: int = 0
    cut_outcomes: dict[str, int] = field(default_factory=lambda: {"new": 0, "old": 0, "miss": 0})
    allowed_misses_write_back: int = 0
    reopen_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def fail(self, text: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(text)


def check_accounting(cache: TieredCache, tally: Tally, where: str) -> None:
    nv = testing.tier(cache, "nvme")
    st = cache.stats()["tiers"]["nvme"]
    lm = testing.lmdb_of(nv)
    with lm.env.begin() as txn:
        meta = {bytes(k): bytes(v) for k, v in txn.cursor(db=lm.meta)}
        quarantined = len(nv.quarantined())
    problems = []
    indexed, placed = nv.stored_keys()  # layout v2: every entry's blocks inside the segment, no overlaps
    if indexed != placed:
        problems.append(f"{len(indexed - placed)} index entries whose payload blocks are missing or shared")
    disk_bytes = blocks = 0
    for d, raw in meta.items():
        try:
            h, loc = parse_index_value(raw)
        except CorruptRecordError as exc:
            problems.append(f"record {d.hex()[:12]}: {exc}")
            continue
        disk_bytes += header_nbytes(raw) + loc.alloc_bytes
        blocks += loc.alloc_bytes
    if st["segment_used_bytes"] != blocks:
        problems.append(f"segment blocks in use {st['segment_used_bytes']} != {blocks} bytes named by the index "
                        "(orphaned payload space not reclaimed?)")
    if st["used_bytes"] != disk_bytes:
        problems.append(f"stats used_bytes {st['used_bytes']} != {disk_bytes} bytes of records in LMDB")
    if not st["entries"] == len(meta) == len(cache):
        problems.append(f"stats entries {st['entries']}, len(cache) {len(cache)}, LMDB headers {len(meta)}")
    if quarantined or st["quarantined"]:
        tally.quarantined_or_corrupt += quarantined
        tally.fail(f"{where}: {quarantined} records quarantined after a crash (a torn record?)")
    if problems:
        tally.accounting_mismatches += 1
        tally.fail(f"{where}: accounting: {'; '.join(problems)}")


def verify(state: VariantState, seed: int, tally: Tally, where: str, strict_overwrite: bool) -> None:
    """Reopen the store and check every key against its journal history (see the module docstring)."""
    cfg = cache_config(state.name, state.store, host=False)  # reads straight from NVMe, no promotion
    t0 = time.perf_counter()
    cache = TieredCache(cfg)
    tally.reopen_s.append(time.perf_counter() - t0)
    try:
        check_accounting(cache, tally, where)
        for key in KEYS:
            tally.keys_checked += 1
            ops = state.ops.get(key, [])
            possible = possible_ops(ops)
            got = cache.get(key)
            present = cache.contains(key)
            if present != (got is not None):
                tally.accounting_mismatches += 1
                tally.fail(f"{where}: {key}: contains()={present} but get() {'hit' if got is not None else 'missed'}")
            cut_put = next((x for x in possible if x.kind == "put" and not x.completed), None)
            # outcomes are counted once, at the check right after the kill that cut the put
            counted_cut = cut_put if cut_put is not None and cut_put.seq in state.just_cut else None
            if got is None:
                tally.misses += 1
                any_done = any(x.completed for x in ops)
                allowed = (not any_done or any(x.kind == "delete" for x in possible)
                           or any(x.kind == "put" and x.completed and not x.durable for x in possible)
                           or (not strict_overwrite and cut_put is not None))
                if not allowed:
                    tally.lost_committed += 1
                    last = max((x for x in ops if x.completed), key=lambda x: x.start)
                    tally.fail(f"{where}: {key}: miss, but put/delete seq {last.seq} completed and is durable")
                elif any(x.kind == "put" and x.completed and not x.durable for x in possible):
                    tally.allowed_misses_write_back += 1
                if counted_cut is not None:
                    tally.cut_outcomes["miss"] += 1
                continue
            tally.hits += 1
            got_bytes = tensor_bytes(got)
            match = None
            for x in possible:
                if x.kind != "put":
                    continue
                want = value_for(seed, x.seq)
                if want.dtype == got.dtype and tuple(want.shape) == tuple(got.shape) and tensor_bytes(want) == got_bytes:
                    match = x
                    break
            if match is None:
                tally.wrong_bytes += 1
                tally.fail(f"{where}: {key}: {got.dtype} {tuple(got.shape)} matches none of the possible puts "
                           f"{[x.seq for x in possible if x.kind == 'put']}")
            elif counted_cut is not None:
                tally.cut_outcomes["new" if match is cut_put else "old"] += 1
            # keep only the ops that may still matter
            state.ops[key] = possible
        for key in set(state.ops) - set(KEYS):
            raise AssertionError(f"journal names a key outside the key space: {key!r}")
        st = cache.stats()["tiers"]["nvme"]
        if st["checksum_failures"]:
            tally.quarantined_or_corrupt += st["checksum_failures"]
            tally.fail(f"{where}: {st['checksum_failures']} records failed their checksum after a crash")
    finally:
        cache.close()
    for key, ops in state.ops.items():
        state.ops[key] = possible_ops(ops)


# ============================================================================ rounds


def in_process_round(state: VariantState, seed: int, rnd: int, rng: random.Random, max_delay_s: float,
                     tally: Tally) -> None:
    journal = state.store.parent / f"journal-{state.name}.log"
    state.journals.setdefault(journal, 0)
    pid = fork_writer(_cache_writer, state.name, state.store, journal, seed, rnd * SEQ_STRIDE)
    time.sleep(rng.uniform(0.0, max_delay_s))
    status = kill_and_reap(pid)
    t_kill = time.monotonic_ns()
    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        tally.writer_errors += 1
        tally.fail(f"round {rnd} ({state.name}): writer ended by itself (status {status}) before the kill")
    parse_journals(state)
    tally.cut_by_kill += end_pending(state, t_kill)
    tally.kills[state.name] = tally.kills.get(state.name, 0) + 1


def _log_tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            return b"".join(f.readlines()[-lines:]).decode(errors="replace")
    except OSError as exc:
        return f"(no log: {exc})"


def _daemon_ready(sock: str, proc: subprocess.Popen, log_path: str, timeout_s: float = 60.0) -> None:
    """Wait for the daemon to answer a ping; RuntimeError with the tail of its log if it exits or
    does not answer within ``timeout_s`` (the last client error is named too)."""
    from ectier.daemon.client import DaemonClient, DaemonUnavailableError

    deadline = time.monotonic() + timeout_s
    last = "no attempt"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode} at start-up; log:\n{_log_tail(log_path)}")
        try:
            with DaemonClient(sock, connect_retry_s=0.0, timeout_s=5) as c:
                c.ping()
                return
        except (DaemonUnavailableError, OSError) as exc:
            last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.05)
    raise RuntimeError(f"daemon not ready in {timeout_s:g} s (last: {last}); log:\n{_log_tail(log_path)}")


def daemon_round(state: VariantState, seed: int, rnd: int, rng: random.Random, max_delay_s: float,
                 tally: Tally, run_dir: str) -> None:
    cfg_path = os.path.join(run_dir, "cfg.json")
    with open(cfg_path, "w") as f:
        json.dump(daemon_config_dict(state.store, run_dir), f)
    sock = os.path.join(run_dir, "d.sock")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ECTIER_")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    log = open(os.path.join(run_dir, "daemon.log"), "ab")
    proc = subprocess.Popen([sys.executable, "-m", "ectier.daemon", "--config", cfg_path], env=env,
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    clients: list[int] = []
    try:
        _daemon_ready(sock, proc, os.path.join(run_dir, "daemon.log"))
        for w in range(2):
            journal = state.store.parent / f"journal-daemon-{w}.log"
            state.journals.setdefault(journal, 0)
            clients.append(fork_writer(_daemon_client_writer, sock, journal, seed,
                                       rnd * SEQ_STRIDE + w * (SEQ_STRIDE // 2)))
        time.sleep(rng.uniform(0.05, max_delay_s + 0.05))
        if rng.random() < 0.3:  # a client dies first, mid-put (its lease must be reclaimed)
            kill_and_reap(clients.pop(0))
            time.sleep(rng.uniform(0.0, max_delay_s / 2))
        proc.kill()  # SIGKILL the daemon mid-put / mid-commit
        proc.wait(30)
        for pid in clients:
            status = kill_and_reap(pid)
            if os.WIFEXITED(status) and os.WEXITSTATUS(status) != 0:
                tally.writer_errors += 1
                tally.fail(f"round {rnd} (daemon): a client failed (exit {os.WEXITSTATUS(status)})")
        clients = []
    finally:
        for pid in clients:
            kill_and_reap(pid)
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()
    t_kill = time.monotonic_ns()
    parse_journals(state)
    tally.cut_by_kill += end_pending(state, t_kill)
    tally.kills["daemon"] = tally.kills.get("daemon", 0) + 1


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def run_campaign(kills: int, seed: int, workdir: Path, *, variants: tuple[str, ...] = VARIANTS,
                 max_delay_s: float = 0.5, daemon_every: int = 10, progress: bool = False) -> dict[str, Any]:
    """Run ``kills`` rounds; returns the report (see the module docstring)."""
    torch.set_num_threads(1)
    workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    states = {v: VariantState(v, workdir / v / "store") for v in variants}
    for s in states.values():
        s.store.parent.mkdir(parents=True, exist_ok=True)
    in_proc = [v for v in variants if v != "daemon"]
    run_dir = tempfile.mkdtemp(prefix="ectcc", dir="/tmp")  # short: AF_UNIX paths are <= 107 bytes
    tally = Tally()
    t_start = time.monotonic()
    try:
        for rnd in range(1, kills + 1):
            if "daemon" in states and (not in_proc or rnd % daemon_every == 0):
                name = "daemon"
                daemon_round(states[name], seed, rnd, rng, max_delay_s, tally, run_dir)
            else:
                name = in_proc[rnd % len(in_proc)]
                in_process_round(states[name], seed, rnd, rng, max_delay_s, tally)
            verify(states[name], seed, tally, f"round {rnd} ({name})", strict_overwrite=name in STRICT_OVERWRITE)
            tally.rounds += 1
            if progress and rnd % 25 == 0:
                print(f"[{time.monotonic() - t_start:7.1f} s] {rnd}/{kills} kills, {tally.keys_checked} keys "
                      f"checked, wrong {tally.wrong_bytes}, lost {tally.lost_committed}", flush=True)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    for s in states.values():
        for path in s.journals:
            if path.exists():
                tally.ops_journaled += sum(1 for line in path.read_text().splitlines() if line[:1] in "ID")
                tally.puts_completed += sum(1 for line in path.read_text().splitlines() if line[:1] == "C")
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_implementation()} "
                   f"{platform.python_version()}, torch {torch.__version__}",
        "seed": seed,
        "kills_requested": kills,
        "kills_survived": tally.rounds,
        "kills_by_variant": tally.kills,
        "keys_checked": tally.keys_checked,
        "hits": tally.hits,
        "misses": tally.misses,
        "wrong_bytes": tally.wrong_bytes,
        "lost_committed": tally.lost_committed,
        "accounting_mismatches": tally.accounting_mismatches,
        "quarantined_or_corrupt": tally.quarantined_or_corrupt,
        "writer_errors": tally.writer_errors,
        "ops_journaled": tally.ops_journaled,
        "puts_completed": tally.puts_completed,
        "ops_cut_by_kill": tally.cut_by_kill,
        "cut_put_outcomes": tally.cut_outcomes,
        "allowed_misses_write_back": tally.allowed_misses_write_back,
        "reopen_s": {"p50": round(statistics.median(tally.reopen_s), 4) if tally.reopen_s else 0.0,
                     "p99": round(_percentile(tally.reopen_s, 0.99), 4),
                     "max": round(max(tally.reopen_s), 4) if tally.reopen_s else 0.0},
        "elapsed_s": round(time.monotonic() - t_start, 1),
        "failures": tally.failures,
    }
    report["ok"] = (tally.rounds == kills and not tally.wrong_bytes and not tally.lost_committed
                    and not tally.accounting_mismatches and not tally.quarantined_or_corrupt
                    and not tally.writer_errors)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="crash_campaign", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=30, help="number of SIGKILLs (rounds), default 30")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workdir", type=Path, default=None, help="default: a fresh temporary directory, removed after")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--max-delay-s", type=float, default=0.5, help="a kill lands uniformly in [0, this] after the fork")
    p.add_argument("--daemon-every", type=int, default=10, help="every Nth round is a daemon round")
    p.add_argument("--progress", action="store_true")
    a = p.parse_args(argv)
    variants = tuple(v for v in a.variants.split(",") if v)
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        p.error(f"--variants: unknown {bad}; known: {', '.join(VARIANTS)}")
    if a.kills < 1 or a.daemon_every < 1 or a.max_delay_s <= 0:
        p.error("--kills, --daemon-every and --max-delay-s must be positive")
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="ectier-crash-"))
    try:
        report = run_campaign(a.kills, a.seed, workdir, variants=variants, max_delay_s=a.max_delay_s,
                              daemon_every=a.daemon_every, progress=a.progress)
    finally:
        if a.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    text = json.dumps(report, indent=2)
    print(text)
    if a.json is not None:
        a.json.write_text(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
