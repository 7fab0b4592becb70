"""Remote tier, Redis backend: put / get GB/s of :class:`~ectier.tiers.remote.redis.RedisBackend`
for several ``remote.chunk_bytes`` against the raw redis-py client's own ``SET`` / ``GET`` of the
same bytes, in the same run (interleaved rounds).

    .venv/bin/python benchmarks/remote_redis_bench.py [--sizes-mib 16,64] [--chunks-mib 1,4,8,16,64]
        [--hash-tag-chunks-mib 4,8] [--rounds 7] [--addresses host:port,...] [--json out.json]

Without ``--addresses`` it starts a 3-node Redis Cluster on loopback (tests/redis_cluster.py;
installs redis-server when missing). Each round times, for every size, one raw ``SET`` and ``GET``
and then one backend ``put`` and ``get`` per chunk size (random bytes, a fresh key per size). The
table gives median GB/s (decimal) and two ratios: of the medians, and the median of the per-round
ratios (``paired``: robust to load that changes during the run). ``other load`` is the share of
the machine's CPU time that processes other than this one and its servers took during the run.
``--hash-tag-chunks-mib`` adds rows of the layout with a hash tag (all chunks of an object on the
node of its manifest) for comparison. Goal (issue 13): backend >= 90 % of the raw client at
>= 16 MiB. Figures: docs/benchmarks.md ("Remote tier: Redis Cluster").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # redis_cluster.py
sys.path.insert(0, str(ROOT / "benchmarks"))

from ectier.config import RemoteTierConfig  # noqa: E402
from ectier.tiers.remote.redis import RedisBackend  # noqa: E402
from remote_common import machine_base, measured, mib_list, report, timed as _timed  # noqa: E402

MiB = 1 << 20
DEADLINE_S = 60.0


@contextlib.contextmanager
def _servers(addresses: str | None) -> Iterator[tuple[str, list[int]]]:
    if addresses:
        yield addresses, []
        return
    from redis_cluster import running_servers
    with running_servers(3) as servers:
        yield servers.addresses, [n.process.pid for n in servers.nodes]


class HashTagged(RedisBackend):
    """The layout with a hash tag: every chunk in the slot of its manifest (one node per object).
    For the measurement only (RedisBackend spreads the chunks over the nodes)."""

    def _manifest_key(self, key: str) -> str:
        return f"{{{self._prefix}:{key}}}:m"

    def _chunk_keys(self, key: str, m: Any) -> list[str]:
        return [f"{{{self._prefix}:{key}}}:c:{m.generation.hex()}:{i}" for i in range(m.n_chunks)]


def _raw_client(addresses: str) -> Any:
    import redis
    from redis.cluster import ClusterNode, RedisCluster
    host, _, port = addresses.split(",")[0].rpartition(":")
    probe = redis.Redis(host, int(port), socket_timeout=DEADLINE_S)
    is_cluster = bool(int(probe.info("cluster").get("cluster_enabled", 0)))
    if not is_cluster:
        return probe
    probe.close()
    return RedisCluster(startup_nodes=[ClusterNode(host, int(port))], socket_timeout=DEADLINE_S)


def measure(addresses: str, sizes: list[int], chunks: list[int], tagged: list[int], rounds: int) -> list[dict]:
    """Rows: one per (size, chunk size, or 'raw', or 'tag <chunk size>') with the per-round put /
    get seconds."""
    raw = _raw_client(addresses)

    def cfg(c: int) -> RemoteTierConfig:
        return RemoteTierConfig(backend="redis", addresses=addresses, prefix="bench", timeout_s=DEADLINE_S,
                                chunk_bytes=c)
    backends: dict[Any, RedisBackend] = {c: RedisBackend(cfg(c)) for c in chunks}
    backends.update({f"tag {c}": HashTagged(cfg(c)) for c in tagged})
    times: dict[tuple[int, Any], dict[str, list[float]]] = {}
    try:
        for size in sizes:
            data = os.urandom(size)
            for r in range(rounds + 1):  # round 0 warms up (connections, server memory)
                dt_put, _ = _timed(lambda: raw.set(f"raw:{size}", data))
                dt_get, got = _timed(lambda: raw.get(f"raw:{size}"))
                assert got == data
                if r:
                    t = times.setdefault((size, "raw"), {"put": [], "get": []})
                    t["put"].append(dt_put)
                    t["get"].append(dt_get)
                for c, be in backends.items():
                    key = f"{size}:{c}"
                    dt_put, _ = _timed(lambda: be.put(key, data, deadline_s=DEADLINE_S))
                    dt_get, got = _timed(lambda: be.get(key, deadline_s=DEADLINE_S))
                    assert got == data
                    if r:
                        t = times.setdefault((size, c), {"put": [], "get": []})
                        t["put"].append(dt_put)
                        t["get"].append(dt_get)
            raw.delete(f"raw:{size}")
            for c, be in backends.items():
                be.delete(f"{size}:{c}", deadline_s=DEADLINE_S)
    finally:
        raw.close()
        for be in backends.values():
            be.close()
    return [{"bytes": s, "chunk_bytes": c, **t} for (s, c), t in times.items()]


def table(rows: list[dict]) -> str:
    raw = {r["bytes"]: r for r in rows if r["chunk_bytes"] == "raw"}
    out = ["| MiB | chunk MiB | put GB/s | raw SET GB/s | put ratio | put paired | get GB/s | raw GET GB/s "
           "| get ratio | get paired |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["chunk_bytes"] == "raw":
            continue
        ref, n = raw[r["bytes"]], r["bytes"]
        c = r["chunk_bytes"]
        cells = [f"{n // MiB}", f"{c / MiB:g}" if isinstance(c, int) else f"{int(c[4:]) / MiB:g}, hash tag"]
        for op in ("put", "get"):
            mine, theirs = statistics.median(r[op]), statistics.median(ref[op])
            paired = statistics.median(t / m for m, t in zip(r[op], ref[op]))
            cells += [f"{n / mine / 1e9:.2f}", f"{n / theirs / 1e9:.2f}", f"{theirs / mine:.0%}", f"{paired:.0%}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def machine() -> dict[str, str]:
    import redis
    try:
        import hiredis
        parser = f"hiredis {hiredis.__version__}"
    except ImportError:
        parser = "pure-Python parser (no hiredis)"
    server = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()
    return {**machine_base(), "redis-py": f"{redis.__version__} ({parser})", "server": server}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="16,64", help="object sizes in MiB")
    ap.add_argument("--chunks-mib", default="1,4,8,16,64", help="remote.chunk_bytes values in MiB")
    ap.add_argument("--hash-tag-chunks-mib", default="", help="also these chunk sizes with hash tags")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (after one warm-up round)")
    ap.add_argument("--addresses", default=None, help="an existing cluster or server (default: start one)")
    ap.add_argument("--json", default=None, help="also write the per-round times here")
    args = ap.parse_args(argv)
    sizes, chunks, tagged = mib_list(args.sizes_mib), mib_list(args.chunks_mib), mib_list(args.hash_tag_chunks_mib)
    with _servers(args.addresses) as (addresses, pids):
        rows, other = measured(pids, lambda: measure(addresses, sizes, chunks, tagged, args.rounds))
    return report(machine(), f"- rounds: {args.rounds}; other load: other processes took {other:.0%} of the "
                  "machine's CPU", table(rows), args.json, {"other_load": other, "rows": rows})

if __name__ == "__main__":
    sys.exit(main())
