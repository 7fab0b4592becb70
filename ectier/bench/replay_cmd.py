"""``ectier bench replay``: a request stream through TieredCache, LRU vs GDSF at equal bytes, and
the hit rate vs capacity curve (``--curve``).

::

    ectier bench replay [--requests 300 --policy lru,gdsf --host-bytes .. --nvme-bytes .. --trace t.csv]
                        [--no-curve] [--width-scale 1] [--curve-scale 32]

``--width-scale`` / ``--curve-scale`` replay entries ``(N, 8192 / scale)`` with both budgets divided by
the same scale (:mod:`ectier.bench.replay`); the budgets are given and reported at full width, and the
output names the budgets the cache held. The last line's seconds are the whole command's, from its
start (imports included) to the last file written.
"""

from __future__ import annotations

import os
from typing import Any

import click

from ..config import format_bytes
from .cli import _bytes, _common, _console, _cost, _machine, _plot, _progress, _stream, _workload, elapsed_s, \
    print_written, resolve_budgets
from .report import fmt, markdown_table, print_table, write_json

__all__ = ["replay_cmd"]

#: the run's entries and the curve's, by their key in a run's result
_POINT_KEYS = ("policy", "fraction_of_working_set", "host_bytes", "nvme_bytes", "held_host_bytes", "held_nvme_bytes",
               "hit_rate", "host_hit_rate", "nvme_hit_rate", "byte_hit_rate", "encoder_saved_s", "saved_fraction",
               "mismatches")


def _replay_rows(runs: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["store", "host", "nvme", "hit %", "host hit %", "nvme hit %", "byte hit %", "enc. saved s",
               "saved %", "moved GB", "get p50 ms", "get p99 ms", "put p50 ms"]
    rows = []
    for r in runs:
        rows.append([r["policy"], format_bytes(r["host_bytes"]) if "host_bytes" in r else "-",
                     format_bytes(r["nvme_bytes"]) if "nvme_bytes" in r else "-",
                     fmt(r["hit_rate"], "pct"), fmt(r.get("host_hit_rate"), "pct"), fmt(r.get("nvme_hit_rate"), "pct"),
                     fmt(r["byte_hit_rate"], "pct"), fmt(r["encoder_saved_s"], "s"), fmt(r["saved_fraction"], "pct"),
                     fmt(r.get("bytes_moved", r.get("hit_bytes", 0) + r.get("put_bytes", 0)), "gb"),
                     fmt(r.get("get_hit_p50_s"), "ms"), fmt(r.get("get_hit_p99_s"), "ms"), fmt(r.get("put_p50_s"), "ms")])
    return headers, rows


def _scaled_note(scale: int, run: dict[str, Any]) -> str:
    """What a scaled replay held: `` (entries scaled 1/8 in width, budgets alike: the cache held host
    X, NVMe Y)``; empty at scale 1."""
    if scale == 1:
        return ""
    return (f" (entries scaled 1/{scale} in width, budgets alike: the cache held host "
            f"{format_bytes(run['held_host_bytes'])}, NVMe {format_bytes(run['held_nvme_bytes'])})")


def _curve_table(points: list[dict[str, Any]], policies: list[str]) -> tuple[list[str], list[list[str]]]:
    from .replay import CURVE_FRACTIONS

    headers = ["budget (% of working set)", "host", "nvme"] + [f"{p} hit %" for p in policies] + \
              [f"{p} saved %" for p in policies]
    rows = []
    for f in CURVE_FRACTIONS:
        sel = {q["policy"]: q for q in points if q["fraction_of_working_set"] == f}
        any_q = next(iter(sel.values()))
        rows.append([f"{f:.0%}", format_bytes(any_q["host_bytes"]), format_bytes(any_q["nvme_bytes"])]
                    + [fmt(sel[p]["hit_rate"], "pct") for p in policies]
                    + [fmt(sel[p]["saved_fraction"], "pct") for p in policies])
    return headers, rows


def _compare(runs: list[dict[str, Any]], points: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["policy"]: r for r in runs}
    if "lru" not in by or "gdsf" not in by:
        return {}
    lru, gd = by["lru"]["encoder_saved_s"], by["gdsf"]["encoder_saved_s"]
    gain = (gd - lru) / lru if lru > 0 else None
    curve_gains = []
    for f in sorted({q["fraction_of_working_set"] for q in points}):
        sel = {q["policy"]: q for q in points if q["fraction_of_working_set"] == f}
        if sel.get("lru", {}).get("encoder_saved_s"):
            curve_gains.append([f, (sel["gdsf"]["encoder_saved_s"] - sel["lru"]["encoder_saved_s"])
                                / sel["lru"]["encoder_saved_s"]])
    if gain is None:
        text = "LRU saved no encoder time; no ratio."
    else:
        text = (f"GDSF vs LRU at equal bytes: encoder time saved {gd:.2f} s vs {lru:.2f} s = {gain:+.1%} "
                f"(goal >= +15 %: {'met' if gain >= 0.15 else 'NOT met'}).")
        if curve_gains:
            text += " Across the capacity curve: " + ", ".join(f"{f:.0%}: {g:+.1%}" for f, g in curve_gains) + "."
        if gain < 0.15:
            text += (" GDSF keeps the entries with the most recompute seconds per byte; its margin over LRU is"
                     " small when the budget already holds most of the re-used images, or when the popular"
                     " images are the large ones (cost per byte then differs little).")
    return {"gdsf_saved_s": gd, "lru_saved_s": lru, "gdsf_gain": gain, "curve_gains": curve_gains, "text": text}


def _replay_all(console, quiet, stream, summ, cost, policies, host_bytes, nvme_bytes, curve, curve_scale,
                width_scale, sync, workdir) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The main runs (one per policy) and, with ``curve``, the curve's points."""
    from .replay import CURVE_FRACTIONS, default_budgets, replay_stream

    runs, points = [], []
    with _progress(console, quiet) as prog:
        for p in policies:
            task = prog.add_task(f"replay {p}", total=len(stream))
            runs.append(replay_stream(stream, cost, policy=p, host_bytes=host_bytes, nvme_bytes=nvme_bytes,
                                      width_scale=width_scale, sync=sync, workdir=workdir,
                                      advance=lambda k, t=task: prog.advance(t, k)))
        for f in CURVE_FRACTIONS if curve else ():
            h, nv = default_budgets(summ["unique_bytes"], f)
            for p in policies:
                task = prog.add_task(f"curve {p} {f:.0%}", total=len(stream))
                r = replay_stream(stream, cost, policy=p, host_bytes=h, nvme_bytes=nv, width_scale=curve_scale,
                                  sync=sync, workdir=workdir, advance=lambda k, t=task: prog.advance(t, k))
                r["fraction_of_working_set"] = f
                points.append({k: r[k] for k in _POINT_KEYS})
    return runs, points


@click.command("replay")
@_common
@_workload
@click.option("--host-bytes", callback=_bytes, default=None, help="host budget (default: 5 % of the working set)")
@click.option("--nvme-bytes", callback=_bytes, default=None, help="NVMe budget (default: 15 % of the working set)")
@click.option("--policy", default="lru,gdsf", show_default=True, help="comma-separated: lru, gdsf")
@click.option("--curve/--no-curve", default=True, show_default=True, help="hit rate vs capacity (5 budgets)")
@click.option("--curve-scale", default=32, show_default=True, type=click.IntRange(1),
              help="curve entries are (N, 8192/scale) with budgets / scale: same decisions, fewer bytes")
@click.option("--width-scale", default=1, show_default=True, type=click.IntRange(1),
              help="same for the main runs (1 = real (N, 8192) entries)")
@click.option("--sync/--no-sync", default=False, show_default=True, help="nvme.sync (fsync per commit)")
def replay_cmd(out, cost_model, workdir, quiet, trace, requests, items, zipf, seed, max_tokens, host_bytes,
               nvme_bytes, policy, curve, curve_scale, width_scale, sync) -> None:
    """Replay a request stream through TieredCache: hit rates by tier, encoder time saved, latency."""
    from .report import plot_curve
    from .workload import stream_summary

    console = _console()
    policies = [p.strip() for p in policy.split(",") if p.strip()]
    bad = [p for p in policies if p not in ("lru", "gdsf")]
    if bad or not policies:
        what = f"unknown policy {', '.join(map(repr, bad))}" if bad else f"no policy named in {policy!r}"
        raise click.BadParameter(f"{what}; use lru, gdsf (comma-separated)", param_hint="--policy")
    for flag, scale in (("--width-scale", width_scale), ("--curve-scale", curve_scale)):
        if 8192 % scale:
            raise click.BadParameter(f"{scale} does not divide 8192 (the entries' width); use a power of two",
                                     param_hint=flag)
    cost = _cost(cost_model)
    stream, source = _stream(trace, requests, items, zipf, seed, max_tokens)
    summ = stream_summary(stream)
    host_bytes, nvme_bytes = resolve_budgets(summ, host_bytes, nvme_bytes)
    runs, points = _replay_all(console, quiet, stream, summ, cost, policies, host_bytes, nvme_bytes, curve,
                               curve_scale, width_scale, sync, workdir)
    comparison = _compare(runs, points)
    result = {"command": "replay", "machine": _machine(), "cost_model": cost.to_dict(), "workload": {**source, **summ},
              "runs": runs, "curve": points, "curve_scale": curve_scale, "width_scale": width_scale,
              "comparison": comparison}
    headers, rows = _replay_rows(runs)
    title = (f"replay: {summ['requests']} requests, {summ['unique_items']} images, working set "
             f"{format_bytes(summ['unique_bytes'])}; recompute cost: {cost.description}"
             + _scaled_note(width_scale, runs[0]))
    print_table(console, title, headers, rows)
    md = [f"### replay\n\n{title}\n\n", markdown_table(headers, rows)]
    if points:
        ch, crow = _curve_table(points, policies)
        print_table(console, f"hit rate vs capacity (entries scaled 1/{curve_scale} in width, budgets alike)", ch, crow)
        md += ["\n", markdown_table(ch, crow)]
    if comparison.get("text"):
        console.print(comparison["text"])
        md.append("\n" + comparison["text"] + "\n")
    if any(r["mismatches"] for r in runs) or any(q["mismatches"] for q in points):
        console.print("[red]byte mismatches on hits: see replay.json[/red]")
    refused = max(r.get("put_refused", 0) for r in runs)
    if refused:
        console.print(f"note: {refused} of {summ['requests']} puts were refused (entries larger than every tier's "
                      f"budget, host {format_bytes(host_bytes)}, NVMe {format_bytes(nvme_bytes)}): they are never "
                      "hits; raise --host-bytes or --nvme-bytes", highlight=False, markup=False)  # (wrapped to COLUMNS)
    result["elapsed_s"] = elapsed_s()  # to the results; the last line's count the plot too
    write_json(result, os.path.join(out, "replay.json"))
    with open(os.path.join(out, "replay.md"), "w") as f:
        f.write("".join(md))
    written = ["replay.json", "replay.md"]
    if points:
        png = os.path.join(out, "replay_curve.png")
        _plot(console, written, png, lambda: plot_curve(points, png, f"({summ['requests']} requests)"))
    else:
        console.print("note: no replay_curve.png (the hit rate vs capacity plot): --no-curve", soft_wrap=True,
                      highlight=False, markup=False)
    print_written(console, out, written)
