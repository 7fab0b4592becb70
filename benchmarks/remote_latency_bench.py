"""Remote tier end to end: how soon another node sees a put, and the remote tier's own put / get
GB/s against the raw redis-py client's ``SET`` / ``GET`` of the same bytes, in the same run.

    .venv/bin/python benchmarks/remote_latency_bench.py [--backend redis|mooncake] [--visibility-mib 1,16]
        [--trials 30] [--sizes-mib 16,64] [--rounds 7] [--poll-s 0.0005] [--addresses host:port,...]
        [--json out.json]

Without ``--addresses`` it starts a 3-node Redis Cluster on loopback (tests/redis_cluster.py), or
with ``--backend mooncake`` a ``mooncake_master`` and one store node (tests/mooncake_master.py;
visibility only: the Mooncake tier's throughput against the raw client is
benchmarks/remote_mooncake_bench.py).

- **Visibility**: a producer ``TieredCache`` (this process) puts a fresh key; a consumer
  ``TieredCache`` in another process (its own GIL), already polling ``get`` of that key every
  ``--poll-s``, records when the get returns the tensor. Latency = that moment minus the moment the
  producer's ``put`` returned (``time.monotonic``, one clock for both processes): the background
  write-through, the store, the consumer's fetch and placement. Reference (``raw``): the producer
  calls the raw client's write of the same bytes (redis-py ``SET``; Mooncake ``put``), the consumer
  polls its read (``GET``; ``get``); latency from the moment the write was called (a synchronous
  writer cannot return earlier). The two alternate trial by
trial; p50 / p99 over ``--trials`` and the median of the per-trial ratios (``paired``).
- **Throughput**: ``RemoteTier.write`` (the record: header, xxh3, chunks + manifest) and
  ``RemoteTier.fetch`` (manifest, chunks, every check, the bytes into a new tensor) against raw
  ``SET`` / ``GET`` of the tensor's bytes, interleaved rounds after one warm-up; median GB/s, the
  ratio of the medians and the median of the per-round ratios (``paired``); and the two parts of a
  put, timed apart in the same rounds: joining the record (header + payload) into one buffer, and
  the backend's put of that buffer. Goal (issue 13): >= 90 % of the raw client at >= 16 MiB.

Figures: docs/benchmarks.md ("Remote tier: visibility across nodes, and the tier against the raw
client").
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import remote_redis_bench as rb  # noqa: E402
from remote_common import measured, mib_list, report, timed as _timed  # noqa: E402

MiB = 1 << 20
DEADLINE_S = 60.0


def _tensor(nbytes: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, (nbytes // 2,), generator=g, dtype=torch.int16).view(torch.bfloat16)


def _remote(spec: dict) -> dict:
    """The ``remote:`` config section for the store ``spec`` describes (see :func:`_spec`)."""
    if spec["backend"] == "redis":
        return {"backend": "redis", "addresses": spec["addresses"], "prefix": "benchvis", "timeout_s": DEADLINE_S}
    return {"backend": "mooncake", "addresses": spec["addresses"], "mooncake_metadata_server": spec["metadata"],
            "mooncake_global_segment_bytes": 0, "mooncake_local_buffer_bytes": "128MiB", "timeout_s": DEADLINE_S}


def _cache(spec: dict, host_bytes: int):
    from ectier import CacheConfig, TieredCache

    return TieredCache(CacheConfig.from_dict({
        "namespace": "bench", "host": {"capacity_bytes": host_bytes, "pin_memory": False}, "remote": _remote(spec)}))


class _RawMooncake:
    """The raw Mooncake client with the calls the visibility trials make (a miss reads ``None``)."""

    def __init__(self, spec: dict) -> None:
        from mooncake.store import MooncakeDistributedStore
        self.c = MooncakeDistributedStore()
        rc = self.c.setup("127.0.0.1", spec["metadata"], 0, 128 * MiB, "tcp", "", spec["addresses"])
        if rc != 0:
            raise RuntimeError(f"raw Mooncake client setup failed: {rc}")

    def set(self, key: str, data: bytes) -> None:
        rc = self.c.put(key, data)
        if rc != 0:
            raise RuntimeError(f"raw Mooncake put failed: {rc}")

    def get(self, key: str):
        return self.c.get(key) or None  # b"" on a miss

    def delete(self, key: str) -> None:
        self.c.remove(key)

    def close(self) -> None:
        self.c.close()


def _raw(spec: dict):
    return rb._raw_client(spec["addresses"]) if spec["backend"] == "redis" else _RawMooncake(spec)


def _consumer(conn, spec: dict, mode: str, poll_s: float) -> None:
    """The other node: for each ``(key, nbytes)`` received, answer ``"polling"``, then poll until
    the entry is there and send back ``(monotonic time it was, seconds the successful get took)``
    (``None`` after 60 s)."""
    cache = _cache(spec, 256 * MiB) if mode == "ectier" else None
    raw = _raw(spec) if mode == "raw" else None
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                return
            key, nbytes = msg
            conn.send("polling")
            end = time.monotonic() + 60
            seen = None
            while time.monotonic() < end:
                t_get = time.monotonic()
                got = cache.get(key) if cache is not None else raw.get(key)
                if got is not None:
                    seen = time.monotonic()
                    assert (got.numel() * got.element_size() if cache is not None else len(got)) == nbytes
                    break
                time.sleep(poll_s)
            conn.send(None if seen is None else (seen, seen - t_get))
    finally:
        if cache is not None:
            cache.close()
        if raw is not None:
            raw.close()


def visibility(spec: dict, sizes: list[int], trials: int, poll_s: float) -> list[dict]:
    """Per size and mode (``ectier``, ``raw``): the latencies (seconds) of every trial; the two
    modes' trials alternate (each has its consumer process, both started first)."""
    import torch

    ctx = multiprocessing.get_context("spawn")
    pipes, procs = {}, []
    producer = _cache(spec, 512 * MiB)
    raw = _raw(spec)
    try:
        for mode in ("ectier", "raw"):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_consumer, args=(child, spec, mode, poll_s), daemon=True)
            proc.start()
            pipes[mode] = parent
            procs.append(proc)
        lat: dict[tuple[str, int], list[float]] = {}
        fetch: dict[tuple[str, int], list[float]] = {}
        for size in sizes:
            for i in range(trials + 1):  # trial 0 warms up
                t = _tensor(size, i)
                for mode, conn in pipes.items():
                    key = f"vis:{mode}:{size}:{i}"
                    conn.send((key, size))
                    assert conn.recv() == "polling"
                    if mode == "ectier":
                        producer.put(key, t)
                        t0 = time.monotonic()
                    else:
                        data = t.view(torch.uint8).numpy().tobytes()
                        t0 = time.monotonic()
                        raw.set(key, data)
                    got = conn.recv()
                    assert got is not None, f"{key} never became visible"
                    if i:
                        lat.setdefault((mode, size), []).append(got[0] - t0)
                        fetch.setdefault((mode, size), []).append(got[1])
                    if mode == "ectier":
                        producer.delete(key)  # keeps the store small (the remote copy goes too)
                    else:
                        raw.delete(key)
    finally:
        for conn in pipes.values():
            conn.send(None)
        for proc in procs:
            proc.join(30)
        producer.close()
        raw.close()
    return [{"mode": m, "bytes": n, "latency_s": v, "last_get_s": fetch[m, n]} for (m, n), v in lat.items()]


def throughput(addresses: str, sizes: list[int], rounds: int) -> list[dict]:
    """Per size: RemoteTier write / fetch seconds and raw SET / GET seconds, per round."""
    import torch

    from ectier.codec import RawCodec
    from ectier.config import RemoteTierConfig
    from ectier.entry import EntryMeta, entry_digest
    from ectier.tiers.nvme_record import encode_record
    from ectier.tiers.remote import open_backend
    from ectier.tiers.remote.tier import RemoteTier

    cfg = RemoteTierConfig(backend="redis", addresses=addresses, prefix="benchtier", timeout_s=DEADLINE_S)
    tier = RemoteTier(cfg, open_backend(cfg))
    raw = rb._raw_client(addresses)
    rows = []
    try:
        for size in sizes:
            t = _tensor(size, size)
            src = t.view(torch.uint8)
            data = src.numpy().tobytes()
            meta = EntryMeta("bench", f"k{size}", "bfloat16", tuple(t.shape), size)
            digest = entry_digest("bench", f"k{size}")
            times: dict[str, list[float]] = {"put": [], "get": [], "raw_put": [], "raw_get": [], "join": [],
                                             "backend_put": []}
            for r in range(rounds + 1):
                # the parts of a put: the record joined into one buffer, the backend's put of it
                rec = encode_record(RawCodec(), meta, src, r + 1)
                dt_j, packed = _timed(lambda: b"".join((rec.header_bytes, rec.payload)))
                dt_b, _ = _timed(lambda: tier.backend.put(tier.key_of(digest), packed, deadline_s=DEADLINE_S))
                packed = None  # freed before the next allocation, as a write-through frees it
                dt_rp, _ = _timed(lambda: raw.set(f"raw:{size}", data))
                dt_rg, got = _timed(lambda: raw.get(f"raw:{size}"))
                assert got == data
                dt_p, ok = _timed(lambda: tier.write(meta, src, r + 1, digest))
                dt_g, got = _timed(lambda: tier.fetch(digest, "bench", f"k{size}"))
                assert ok and got is not None and got[1].numel() == size
                if r:
                    for k, v in (("put", dt_p), ("get", dt_g), ("raw_put", dt_rp), ("raw_get", dt_rg),
                                 ("join", dt_j), ("backend_put", dt_b)):
                        times[k].append(v)
            raw.delete(f"raw:{size}")
            tier.delete(digest)
            rows.append({"bytes": size, **times})
    finally:
        raw.close()
        tier.close()
    return rows


@contextlib.contextmanager
def _spec(backend: str, addresses: str | None) -> Iterator[tuple[dict, list[int]]]:
    """``({"backend", "addresses"[, "metadata"]}, server pids)``: the store the trials use, started
    on loopback for the block unless ``addresses`` names one."""
    if backend == "redis":
        with rb._servers(addresses) as (addrs, pids):
            yield {"backend": "redis", "addresses": addrs}, pids
        return
    import remote_mooncake_bench as mb  # needs the Mooncake client: imported only here
    with mb._store(addresses, None) as (master, metadata, pids):
        yield {"backend": "mooncake", "addresses": master, "metadata": metadata}, pids


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def tables(vis: list[dict], thr: list[dict]) -> str:
    out = ["| MiB | ectier p50 ms | ectier p99 ms | raw p50 ms | raw p99 ms | p50 ectier / raw | paired "
           "| of it the hit's get, p50 ms: ectier / raw |", "|---|---|---|---|---|---|---|---|"]
    by = {(r["mode"], r["bytes"]): r for r in vis}
    for size in sorted({r["bytes"] for r in vis}):
        e, r = by["ectier", size]["latency_s"], by["raw", size]["latency_s"]
        ge, gr = by["ectier", size]["last_get_s"], by["raw", size]["last_get_s"]
        paired = statistics.median(a / b for a, b in zip(e, r))
        out.append(f"| {size / MiB:g} | {_pct(e, .5) * 1e3:.1f} | {_pct(e, .99) * 1e3:.1f} | {_pct(r, .5) * 1e3:.1f} "
                   f"| {_pct(r, .99) * 1e3:.1f} | {_pct(e, .5) / _pct(r, .5):.2f} | {paired:.2f} "
                   f"| {_pct(ge, .5) * 1e3:.1f} / {_pct(gr, .5) * 1e3:.1f} |")
    if not thr:
        return "\n".join(out)
    out += ["", "| MiB | put GB/s | raw SET GB/s | put ratio | put paired | get GB/s | raw GET GB/s | get ratio "
            "| get paired | put's parts, ms: join / backend put / raw SET |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in thr:
        n = row["bytes"]
        cells = [f"{n / MiB:g}"]
        for op in ("put", "get"):
            mine, theirs = statistics.median(row[op]), statistics.median(row[f"raw_{op}"])
            paired = statistics.median(t / m for m, t in zip(row[op], row[f"raw_{op}"]))
            cells += [f"{n / mine / 1e9:.2f}", f"{n / theirs / 1e9:.2f}", f"{theirs / mine:.0%}", f"{paired:.0%}"]
        cells.append(" / ".join(f"{statistics.median(row[k]) * 1e3:.0f}" for k in ("join", "backend_put", "raw_put")))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--visibility-mib", default="1,16", help="entry sizes of the visibility trials, MiB")
    ap.add_argument("--trials", type=int, default=30, help="visibility trials per size and mode (after a warm-up)")
    ap.add_argument("--poll-s", type=float, default=0.0005, help="the consumer's pause between two polls")
    ap.add_argument("--sizes-mib", default="16,64", help="entry sizes of the throughput rounds, MiB")
    ap.add_argument("--rounds", type=int, default=7, help="throughput rounds (after one warm-up round)")
    ap.add_argument("--backend", choices=("redis", "mooncake"), default="redis",
                    help="the remote store (mooncake: visibility trials only)")
    ap.add_argument("--addresses", default=None, help="an existing cluster or server (default: start one); "
                    "mooncake: the master's host:port, the metadata server at http://<host>:8080/metadata")
    ap.add_argument("--json", default=None, help="also write every measurement here")
    args = ap.parse_args(argv)
    vsizes, tsizes = mib_list(args.visibility_mib), mib_list(args.sizes_mib)

    def run() -> tuple[list, list]:
        thr = throughput(spec["addresses"], tsizes, args.rounds) if args.backend == "redis" else []
        return thr, visibility(spec, vsizes, args.trials, args.poll_s)

    with _spec(args.backend, args.addresses) as (spec, pids):
        (thr, vis), other = measured(pids, run)
    if args.backend == "redis":
        info: dict[str, Any] = rb.machine()
    else:
        import remote_mooncake_bench as mb
        info = mb.machine()
    return report(info, f"- trials: {args.trials}, poll every {args.poll_s * 1e3:g} ms; rounds: {args.rounds}; "
                  f"other load: other processes took about {other:.0%} of the machine's CPU (the consumer process "
                  "counts as other)", tables(vis, thr), args.json, {"other_load": other, "visibility": vis,
                                                                   "throughput": thr})

if __name__ == "__main__":
    sys.exit(main())
