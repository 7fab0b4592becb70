"""The same stream through the demo's safetensors-file-per-item store and through pure recomputation.

- **safetensors**: :class:`ectier.demo_baseline.SafetensorsPerItemStore` (vLLM's ``ECExampleConnector``
  behaviour: one file per ``mm_hash``, synchronous, no eviction - its disk use is unbounded, so its
  hit rate is the best any cache could reach on the stream).
- **recompute**: no cache; every request costs the encoder time of the cost model.

Per request the store's ``has``/``load`` (hit) or ``save`` (miss) is timed, as ectier's get/put are.
A hit is read as ectier's replay reads one (``get(out=...)`` into a reused buffer): the lazily
mapped file's bytes are copied, inside the timer, into the same kind of reused buffer, so neither
side pays the page faults of a freshly allocated tensor per hit.

:func:`compare_stores` puts them side by side: encoder seconds still spent plus cache I/O seconds,
against recomputing everything. That ratio means something only when both come from one machine:
cache I/O is always measured here, so the cost model must be too (``measured`` or ``scaled``,
:attr:`CostModel.on_this_machine`); with the H200-fitted model the result says it is *not* like
with like.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from typing import Any, Callable, Sequence

from ..config import format_bytes
from ..demo_baseline import SafetensorsPerItemStore
from .costmodel import CostModel
from .replay import EntryFactory, percentile
from .report import fmt
from .workload import Request

__all__ = ["replay_safetensors", "recompute_only", "compare_stores", "baseline_rows"]


def replay_safetensors(
    stream: Sequence[Request],
    cost: CostModel,
    *,
    width: int = 8192,
    workdir: str | None = None,
    advance: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Replay ``stream`` through a fresh SafetensorsPerItemStore in a temp dir (removed after).

    Returns the same keys as :func:`ectier.bench.replay.replay_stream` where they apply (hits,
    hit_rate, byte_hit_rate, encoder_saved_s, encoder_spent_s, get_s, put_s, latency
    percentiles in seconds) plus ``disk_bytes`` (bytes written, never evicted).
    """
    max_tokens = max(r.num_tokens for r in stream)
    factory = EntryFactory(max_tokens * width * 2, width)
    tmp = tempfile.mkdtemp(prefix="ectier-st-", dir=workdir)
    store = SafetensorsPerItemStore(tmp)
    n = dict(hits=0, misses=0, mismatches=0)
    b = dict(requested=0, hit=0, put=0)
    enc = dict(total=0.0, saved=0.0, spent=0.0)
    lat: dict[str, list[float]] = dict(hit=[], put=[], get=[])
    t_start = time.perf_counter()
    try:
        for r in stream:
            nb = r.num_tokens * width * 2
            c = cost.seconds(r.num_tokens)
            enc["total"] += c
            b["requested"] += nb
            t0 = time.perf_counter()
            got = _load_into(store, r.mm_hash, factory.out(r.num_tokens))
            dt = time.perf_counter() - t0
            lat["get"].append(dt)
            if got is not None:
                n["hits"] += 1
                b["hit"] += nb
                lat["hit"].append(dt)
                enc["saved"] += c
                n["mismatches"] += not factory.check(r.mm_hash, r.num_tokens, got)
            else:
                n["misses"] += 1
                enc["spent"] += c
                t0 = time.perf_counter()
                store.save(r.mm_hash, factory.entry(r.mm_hash, r.num_tokens))
                lat["put"].append(time.perf_counter() - t0)
                b["put"] += nb
            if advance is not None:
                advance(1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    reqs = len(stream)
    return {
        "policy": "safetensors-per-item (no eviction)",
        "requests": reqs, **n,
        "requested_bytes": b["requested"], "hit_bytes": b["hit"], "put_bytes": b["put"], "disk_bytes": b["put"],
        "hit_rate": n["hits"] / reqs, "byte_hit_rate": b["hit"] / (b["requested"] or 1),
        "encoder_total_s": enc["total"], "encoder_saved_s": enc["saved"], "encoder_spent_s": enc["spent"],
        "saved_fraction": enc["saved"] / enc["total"] if enc["total"] else 0.0,
        "get_s": sum(lat["get"]), "put_s": sum(lat["put"]),
        "get_hit_p50_s": percentile(lat["hit"], 50), "get_hit_p99_s": percentile(lat["hit"], 99),
        "put_p50_s": percentile(lat["put"], 50), "put_p99_s": percentile(lat["put"], 99),
        "wall_s": time.perf_counter() - t_start,
    }


def _load_into(store: SafetensorsPerItemStore, mm_hash: str, out):
    """``out`` with every byte of ``mm_hash``'s file copied into it, or None when there is no file.

    The same work as ectier's ``get(key, out=buffer)``: the lazy map of the file is read once into
    a buffer the caller reuses (a ``clone`` would also pay a fresh tensor's page faults, which
    ectier's side never does: docs/bench-harness.md, "baseline")."""
    if not store.has(mm_hash):
        return None
    mapped = store.load(mm_hash, materialize=False)
    if tuple(mapped.shape) != tuple(out.shape) or mapped.dtype != out.dtype:
        return mapped  # not what was saved: the check counts it as a mismatch
    out.copy_(mapped)
    del mapped
    return out


def recompute_only(stream: Sequence[Request], cost: CostModel) -> dict[str, Any]:
    """No cache: every request runs the encoder. Seconds from ``cost``; nothing measured."""
    total = sum(cost.seconds(r.num_tokens) for r in stream)
    return {"policy": "recompute (no cache)", "requests": len(stream), "hits": 0, "misses": len(stream),
            "hit_rate": 0.0, "byte_hit_rate": 0.0, "encoder_total_s": total, "encoder_saved_s": 0.0,
            "encoder_spent_s": total, "saved_fraction": 0.0, "get_s": 0.0, "put_s": 0.0}


def compare_stores(stores: list[dict[str, Any]], cost: CostModel) -> dict[str, Any]:
    """Set ``encoder_plus_io_s`` and ``ratio_vs_recompute`` on every row of ``stores`` (in place;
    the first row is :func:`recompute_only`'s) and say whether the comparison is like with like.

    Returns:
        ``{"like_with_like": bool, "encoder_seconds": str, "cache_io": str, "text": str}``: like
        with like when ``cost`` was timed on this machine (cache I/O always is).
    """
    rec = stores[0]["encoder_total_s"]
    for r in stores:
        r["encoder_plus_io_s"] = r["encoder_spent_s"] + r["get_s"] + r["put_s"]
        r["ratio_vs_recompute"] = r["encoder_plus_io_s"] / rec if rec else None
    like = cost.on_this_machine
    if like:
        text = (f"like with like: encoder seconds and cache I/O both from this machine "
                f"(encoder: {cost.description}).")
    else:
        text = (f"NOT like with like: encoder seconds are {cost.description}, cache I/O is measured on this "
                "machine, so 'vs recompute' mixes two machines (--cost-model auto, scaled or measured times "
                "the encoder here).")
    return {"like_with_like": like, "encoder_seconds": cost.description, "cache_io": "measured on this machine",
            "text": text}


def baseline_rows(stores: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Table headers and rows of :func:`compare_stores`'s output (seconds, %, bytes as text)."""
    headers = ["store", "hit %", "encoder s", "cache I/O s", "encoder + I/O s", "vs recompute", "get p50 ms",
               "put p50 ms", "disk used"]
    rows = []
    for r in stores:
        disk = r.get("disk_bytes", r.get("nvme_bytes"))
        ratio = r["ratio_vs_recompute"]
        rows.append([r["policy"] if "host_bytes" not in r else f"ectier {r['policy']}", fmt(r["hit_rate"], "pct"),
                     fmt(r["encoder_spent_s"], "s"), fmt(r["get_s"] + r["put_s"], "s"),
                     fmt(r["encoder_plus_io_s"], "s"),
                     f"{ratio:.3g}x" if ratio is not None else "-",
                     fmt(r.get("get_hit_p50_s"), "ms"), fmt(r.get("put_p50_s"), "ms"),
                     format_bytes(disk) + (" (budget)" if "host_bytes" in r else "") if disk is not None else "-"])
    return headers, rows
