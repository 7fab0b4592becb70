"""Remote tier, Mooncake Store backend: put / get GB/s of ectier's remote tier on Mooncake against
the raw Mooncake client's put / get of the same bytes, in the same run (interleaved rounds).

    .venv/bin/python benchmarks/remote_mooncake_bench.py [--sizes-mib 16,64] [--rounds 9]
        [--master host:port --metadata http://host:port/metadata] [--json out.json]

Without ``--master`` it starts ``mooncake_master`` (HTTP metadata server on) and one store node
(``mooncake_client``, 2 GB) on loopback (tests/mooncake_master.py); every client here lends no
memory, so every byte crosses the transfer engine (TCP) to the store node and back. Rows, per
size (random bytes, a fresh key per row):

- ``raw``: the raw client's plain ``upsert`` / ``get`` (the reference of the goal);
- ``raw registered``: ``upsert_from`` / ``get_into`` from buffers registered once, before the run
  (the client's best case: no copy, no registration per call);
- ``backend``: :class:`~ectier.tiers.remote.mooncake.MooncakeBackend` ``put`` / ``get`` (what ships:
  a put registers the caller's buffer for the call, ``upsert_from``; a get reads into a buffer of
  the pool of registered memory, ``get_into``, its size known from the last put);
- ``backend plain``: the backend with ``zero_copy = False`` (plain ``upsert`` / ``get``);
- ``tier``: :class:`~ectier.tiers.remote.tier.RemoteTier` ``write`` / ``fetch`` on ``backend``
  (the record: header, xxh3 checksum; a put copies header + payload into a pool buffer, the
  checksum computed during the copy, and writes it with ``upsert_from``; a fetch reads into a
  pool buffer and hands the payload out as a view of it, no copy);
- ``tier, checksum known``: ``tier``, the payload's xxh3 given (``RemoteTier.write(payload_checksum=)``),
  as the write-through of an entry whose raw NVMe record of that version carries it: no pass for
  it (records > 32 MiB go through ``upsert_parts``, which otherwise follows a checksum pass);
- ``tier, size asked``: ``tier`` on a backend that does not know the object's size (as a node
  reading what another wrote: ``get_size`` first).

The table gives median GB/s (decimal) and, against ``raw``, the ratio of the medians and the
median of the per-round ratios (``paired``), and the median CPU time this process spent per put /
get (its client's threads included; not the servers'): on a loaded machine a steadier figure of
what each row costs than its GB/s. ``other load``: the share of the machine's CPU that
processes other than this one and its servers took. Goal (issue 13): >= 90 % of the raw client at
>= 16 MiB. Figures: docs/benchmarks.md ("Remote tier: Mooncake Store").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # mooncake_master.py
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import xxhash  # noqa: E402

from ectier.config import RemoteTierConfig  # noqa: E402
from ectier.entry import EntryMeta, entry_digest  # noqa: E402
from ectier.tiers.remote.mooncake import MooncakeBackend  # noqa: E402
from ectier.tiers.remote.tier import RemoteTier  # noqa: E402
from remote_common import machine_base, measured, mib_list, report  # noqa: E402

MiB = 1 << 20
DEADLINE_S = 60.0
ROWS = ("raw", "raw registered", "backend", "backend plain", "tier", "tier, checksum known", "tier, size asked")


class PlainBackend(MooncakeBackend):
    """The backend through Mooncake's plain ``upsert`` / ``get`` (for the measurement only)."""

    zero_copy = False


class AskingBackend(MooncakeBackend):
    """The backend asking every object's size (``get_size``), as for an object another node wrote."""

    size_hints = 0


@contextlib.contextmanager
def _store(master: str | None, metadata: str | None) -> Iterator[tuple[str, str, list[int]]]:
    if master:
        yield master, metadata or f"http://{master.rpartition(':')[0]}:8080/metadata", []
        return
    from mooncake_master import running_store
    with running_store(node_segment="2GB") as s:
        yield s.master_address, s.metadata_server, [s.master.process.pid, s.node.process.pid]


def _raw_client(master: str, metadata: str, local_buffer: int) -> Any:
    from mooncake.store import MooncakeDistributedStore
    c = MooncakeDistributedStore()
    rc = c.setup("127.0.0.1", metadata, 0, local_buffer, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"raw Mooncake client setup failed: {rc}")
    return c


def _timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """``(wall seconds, this process's CPU seconds, fn())``."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out


def _ops(size: int, data: bytes, raw: Any, reg: tuple[torch.Tensor, torch.Tensor], be: MooncakeBackend,
         plain: MooncakeBackend, tier: RemoteTier, asking: RemoteTier) -> dict[str, tuple[Callable, Callable]]:
    """Per row: (put, get); each get returns something to check against ``data``."""
    src, dst = reg
    meta = EntryMeta("bench", f"t{size}", "uint8", (size,), size)
    digest = entry_digest("bench", f"t{size}")
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    known = xxhash.xxh3_64_intdigest(data)  # as the entry's raw NVMe record of this version carries it

    def raw_get_into() -> memoryview:
        n = raw.get_into(f"rr{size}", dst.data_ptr(), size)
        assert n == size, n
        return memoryview(dst.numpy())[:size]

    def fetch(t: RemoteTier) -> memoryview:
        got = t.fetch(digest, "bench", f"t{size}")
        assert got is not None
        return memoryview(got[1].numpy())

    return {
        "raw": (lambda: raw.upsert(f"r{size}", data), lambda: raw.get(f"r{size}")),
        "raw registered": (lambda: raw.upsert_from(f"rr{size}", src.data_ptr(), size), raw_get_into),
        "backend": (lambda: be.put(f"b{size}", data, deadline_s=DEADLINE_S),
                    lambda: be.get(f"b{size}", deadline_s=DEADLINE_S)),
        "backend plain": (lambda: plain.put(f"p{size}", data, deadline_s=DEADLINE_S),
                          lambda: plain.get(f"p{size}", deadline_s=DEADLINE_S)),
        "tier": (lambda: tier.write(meta, payload, 1, digest), lambda: fetch(tier)),
        "tier, checksum known": (lambda: tier.write(meta, payload, 1, digest, payload_checksum=known),
                                 lambda: fetch(tier)),
        "tier, size asked": (lambda: asking.write(meta, payload, 1, digest), lambda: fetch(asking)),
    }


def measure(master: str, metadata: str, sizes: list[int], rounds: int) -> list[dict]:
    """Rows: one per (size, row name) with the per-round put / get seconds."""
    local_buffer = 2 * max(sizes) + 16 * MiB  # the plain paths copy through it
    cfg = RemoteTierConfig(backend="mooncake", addresses=master, prefix="bench", timeout_s=DEADLINE_S,
                           mooncake_metadata_server=metadata, mooncake_global_segment_bytes=0,
                           mooncake_local_buffer_bytes=local_buffer, max_entry_bytes=2 * max(sizes))
    raw = _raw_client(master, metadata, local_buffer)
    be, plain = MooncakeBackend(cfg), PlainBackend(cfg)
    tier, asking = RemoteTier(cfg, MooncakeBackend(cfg)), RemoteTier(cfg, AskingBackend(cfg))
    src, dst = torch.empty(max(sizes), dtype=torch.uint8), torch.empty(max(sizes), dtype=torch.uint8)
    for t in (src, dst):
        assert raw.register_buffer(t.data_ptr(), t.numel()) == 0
    times: dict[tuple[int, str], dict[str, list[float]]] = {}
    try:
        for size in sizes:
            data = os.urandom(size)
            src[:size].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            ops = _ops(size, data, raw, (src, dst), be, plain, tier, asking)
            for r in range(rounds + 1):  # round 0 warms up
                for name in ROWS:
                    put, get = ops[name]
                    dt_put, cpu_put, rc = _timed(put)
                    assert rc in (0, None, True), (name, rc)
                    dt_get, cpu_get, got = _timed(get)
                    assert got is not None and len(got) == size and bytes(got[:64]) == data[:64], name
                    if r:
                        t = times.setdefault((size, name), {"put": [], "get": [], "put_cpu": [], "get_cpu": []})
                        t["put"].append(dt_put)
                        t["get"].append(dt_get)
                        t["put_cpu"].append(cpu_put)
                        t["get_cpu"].append(cpu_get)
            assert bytes(be.get(f"b{size}", deadline_s=DEADLINE_S)) == data
    finally:
        for t in (src, dst):
            raw.unregister_buffer(t.data_ptr())
        for b in (be, plain, tier.backend, asking.backend):
            b.close()
        raw.close()
    return [{"bytes": s, "row": n, **t} for (s, n), t in times.items()]


def table(rows: list[dict]) -> str:
    raw = {r["bytes"]: r for r in rows if r["row"] == "raw"}
    out = ["| MiB | row | put GB/s | put ratio | put paired | get GB/s | get ratio | get paired | put / get CPU ms |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref, n = raw[r["bytes"]], r["bytes"]
        cells = [f"{n // MiB}", r["row"]]
        for op in ("put", "get"):
            mine, theirs = statistics.median(r[op]), statistics.median(ref[op])
            paired = statistics.median(t / m for m, t in zip(r[op], ref[op]))
            cells += [f"{n / mine / 1e9:.2f}", f"{theirs / mine:.0%}", f"{paired:.0%}"]
        cells.append(" / ".join(f"{1e3 * statistics.median(r[op + '_cpu']):.1f}" for op in ("put", "get")))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def machine() -> dict[str, str]:
    from importlib.metadata import version
    return {**machine_base(),
            "mooncake": f"mooncake-transfer-engine-non-cuda {version('mooncake-transfer-engine-non-cuda')}, tcp"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="16,64", help="object sizes in MiB")
    ap.add_argument("--rounds", type=int, default=9, help="timed rounds (after one warm-up round)")
    ap.add_argument("--master", default=None, help="an existing master host:port (default: start one)")
    ap.add_argument("--metadata", default=None, help="its metadata server (default http://<master host>:8080/metadata)")
    ap.add_argument("--json", default=None, help="also write the per-round times here")
    args = ap.parse_args(argv)
    sizes = mib_list(args.sizes_mib)
    with _store(args.master, args.metadata) as (master, metadata, pids):
        rows, other = measured(pids, lambda: measure(master, metadata, sizes, args.rounds))
    return report(machine(), f"- rounds: {args.rounds}; other load: other processes took {other:.0%} of the "
                  "machine's CPU", table(rows), args.json, {"other_load": other, "rows": rows})

if __name__ == "__main__":
    sys.exit(main())
