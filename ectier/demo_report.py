"""The ``ectier demo`` report: a :func:`ectier.demo.run_demo` summary as rich tables.

Every table is laid out to fit in 80 columns at its natural width (no cell has to wrap on an
80-column terminal): long values are split over several short rows instead of one wide cell.
Plain text lines fold at word boundaries on narrower consoles, as rich does.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from .config import format_bytes

__all__ = ["print_summary", "TABLE_WIDTH"]

#: The width every table fits in at its natural size, in characters.
TABLE_WIDTH = 80


def _fmt_gbps(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:.2f} GB/s"


def _fmt_s(v: float) -> str:
    return f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.2f} s"


def _table(title: str, **kw: Any) -> Table:
    return Table(title=title, title_justify="left", show_edge=False, pad_edge=False, **kw)


def _header(summary: dict[str, Any], console: Console) -> None:
    model, opts, budgets, unique = summary["model"], summary["options"], summary["budgets"], summary["unique_bytes"]
    say = lambda text: console.print(text, highlight=False)  # noqa: E731
    say(f"[bold]ectier demo[/] — {model['name']}, encoder output (N, {model['embed_dim']}) {model['dtype']}")
    say(f"{len(summary['images'])} images from {summary['image_source']}, {format_bytes(unique)} unique; "
        f"{opts['requests']} requests, Zipf s={opts['zipf']}, seed {opts['seed']}")
    if summary["image_source"] == "synthetic":
        console.print("[yellow]images are synthetic pixels (scikit-image unavailable)[/]")

    def share(x: int) -> str:
        return f" ({x / unique:.0%} of unique)" if unique else ""

    say(f"budgets: host {format_bytes(budgets['host_bytes'])}{share(budgets['host_bytes'])}, "
        f"NVMe {format_bytes(budgets['nvme_bytes'])}{share(budgets['nvme_bytes'])}")
    say(f"codec {budgets['codec']}, nvme.sync={budgets['sync']}, stores under {budgets['dir']}")


def _images_table(summary: dict[str, Any]) -> Table:
    imgs = _table("working set")
    for col, just in (("image", "left"), ("W×H", "right"), ("tokens", "right"), ("bytes", "right"),
                      ("requests", "right")):
        imgs.add_column(col, justify=just)
    for im in sorted(summary["images"], key=lambda r: -r["requests"]):
        imgs.add_row(im["name"], f"{im['width']}×{im['height']}", str(im["tokens"]),
                     format_bytes(im["nbytes"]), str(im["requests"]))
    return imgs


def _tiers_table(ect: dict[str, Any]) -> Table:
    stats = ect["stats"]
    tiers = _table("tiers (from TieredCache.stats())")
    tiers.add_column("")
    host, nv = stats["tiers"].get("host"), stats["tiers"].get("nvme")
    host_lookups = ect["requests"]
    nvme_lookups = host_lookups - (host["hits"] if host is not None else 0)
    cols = []
    for name, st, lk in (("host", host, host_lookups), ("nvme", nv, nvme_lookups)):
        if st is not None:
            tiers.add_column(name, justify="right")
            cols.append((name, st, lk))

    def row(label: str, fn: Callable[[str, dict, int], str]) -> None:
        tiers.add_row(label, *(fn(name, st, lk) for name, st, lk in cols))

    host_only = lambda key: (lambda n, st, lk: str(st[key]) if n == "host" else "—")  # noqa: E731
    row("lookups", lambda n, st, lk: str(lk))
    row("hits", lambda n, st, lk: str(st["hits"]))
    row("misses", lambda n, st, lk: str(lk - st["hits"]))
    row("hit bytes", lambda n, st, lk: format_bytes(st["hit_bytes"]))
    row("puts", lambda n, st, lk: str(st["puts"]))
    row("put bytes", lambda n, st, lk: format_bytes(st["put_bytes"]))
    row("evictions", lambda n, st, lk: str(st["evictions"]))
    row("demotions (to nvme)", host_only("demotions"))
    row("promotions (to host)", host_only("promotions"))
    row("drops (lost)", host_only("drops"))
    row("entries now", lambda n, st, lk: str(st["entries"]))
    row("used", lambda n, st, lk: format_bytes(st["used_bytes"]))
    row("capacity", lambda n, st, lk: format_bytes(st["capacity_bytes"]))
    return tiers


def _tier_flags(ect: dict[str, Any]) -> list[str]:
    host, nv = ect["stats"]["tiers"].get("host"), ect["stats"]["tiers"].get("nvme")
    extra = []
    if host is not None and (host["skipped_too_large"] or host["admission_timeouts"]):
        extra.append(f"host skipped_too_large={host['skipped_too_large']} "
                     f"admission_timeouts={host['admission_timeouts']}")
    if nv is not None:
        flagged = {k: nv[k] for k in ("skipped_too_large", "write_failures", "read_failures", "checksum_failures",
                                      "quarantined") if nv.get(k)}
        if flagged:
            extra.append("nvme " + " ".join(f"{k}={v}" for k, v in flagged.items()))
    return extra


def _results_table(summary: dict[str, Any]) -> Table:
    ect = summary["ectier"]
    res = _table("ectier results", show_header=False)
    res.add_column("what")
    res.add_column("value")
    res.add_row("hit rate (items)", f"{ect['hit_rate']:.1%}  ({ect['hits']} hits: {ect['host_hits']} host, "
                f"{ect['nvme_hits']} NVMe; {ect['misses']} misses)")
    res.add_row("hit rate (bytes)", f"{ect['byte_hit_rate']:.1%}  ({format_bytes(ect['hit_bytes'])} of "
                f"{format_bytes(ect['requested_bytes'])} requested)")
    res.add_row("get", f"{_fmt_gbps(ect['get_gbps'])}  ({format_bytes(ect['hit_bytes'])} in {_fmt_s(ect['get_s'])})")
    res.add_row("  host hits", _fmt_gbps(ect["get_host_gbps"]))
    res.add_row("  NVMe hits", f"{_fmt_gbps(ect['get_nvme_gbps'])}  (promotion to host included)")
    res.add_row("put", f"{_fmt_gbps(ect['put_gbps'])}  ({format_bytes(ect['put_bytes'])} in {_fmt_s(ect['put_s'])})")
    res.add_row("", "evictions and demotions included")
    if ect["put_refused"]:
        res.add_row("puts refused", f"[yellow]{ect['put_refused']} (not cached, request served)[/]")
        for k, v in ect["put_refusal_reasons"].items():
            res.add_row("", f"[yellow]{k}: {v}[/]")
    res.add_row("encoder (stand-in)", f"{_fmt_s(ect['encoder_s'])} spent on {ect['misses']} misses")
    res.add_row("", f"{_fmt_s(ect['encoder_saved_s'])} saved by {ect['hits']} hits")
    verdict = ("[green]all byte-exact[/]" if ect["mismatches"] == 0
               else f"[bold red]{ect['mismatches']} MISMATCHED[/]")
    res.add_row("verification", f"{ect['hits']} hits vs recomputation: {verdict}")
    for ex in ect["mismatch_examples"]:
        res.add_row("", f"[red]request {ex['request']}: {ex['image']} ({ex['tier']} hit)[/]")
        res.add_row("", f"[red]  mm_hash {ex['mm_hash'][:16]}…[/]")
    res.add_row("time", f"replay {_fmt_s(summary['replay_s'])}")
    res.add_row("", f"of which ectier cache calls {_fmt_s(ect['cache_s'])}")
    return res


def _baseline(summary: dict[str, Any], console: Console) -> None:
    ect, base, sp = summary["ectier"], summary["baseline"], summary["speedup"]
    cmp_ = _table("vs safetensors file per item (like vLLM's ECExampleConnector)")
    for col in ("op", "ectier", "safetensors per item", "speed-up per byte"):
        cmp_.add_column(col, justify="left" if col == "op" else "right")

    def speed(x: Optional[float]) -> str:
        return "—" if x is None else f"{x:.1f}x"

    cmp_.add_row("load", f"{format_bytes(ect['hit_bytes'])} in {_fmt_s(ect['get_s'])}",
                 f"{format_bytes(base['hit_bytes'])} in {_fmt_s(base['load_s'])}", speed(sp["load"]))
    cmp_.add_row("save", f"{format_bytes(ect['put_bytes'])} in {_fmt_s(ect['put_s'])}",
                 f"{format_bytes(base['save_bytes'])} in {_fmt_s(base['save_s'])}", speed(sp["save"]))
    cmp_.add_row("total", f"{format_bytes(ect['hit_bytes'] + ect['put_bytes'])} in {_fmt_s(ect['cache_s'])}",
                 f"{format_bytes(base['hit_bytes'] + base['save_bytes'])} in {_fmt_s(base['cache_s'])}",
                 speed(sp["total"]))
    console.print(cmp_)
    rows = [r for r in ect.get("by_size", []) if r["speedup"] is not None]
    if rows:
        console.print(_by_size_table(rows))
    say = lambda text: console.print(text, highlight=False)  # noqa: E731
    # a note under a line: wrapped at the console's width, every line indented by two
    note = lambda text: console.print(Padding(Text(text), (0, 0, 0, 2), expand=False))  # noqa: E731
    if rows:
        slower = [r for r in rows if r["speedup"] < 1]
        say(f"ectier load faster at {len(rows) - len(slower)} of {len(rows)} entry sizes"
            + ("" if not slower else f"; slower at {len(slower)}"))
        host, nvme = _tier_wins(rows, "host"), _tier_wins(rows, "nvme")
        if host or nvme:
            host = f"host hits faster at {host} of their sizes" if host else "no host hits"
            nvme = f"NVMe hits at {nvme}" if nvme else "no NVMe hits"
            say(f"  {host}, {nvme}")
    for op, word in (("load", "load"), ("save", "save"), ("total", "load+save")):
        x = sp[op]
        if x is not None:
            rel = f"{x:.1f}x faster than" if x >= 1 else f"{1 / x:.1f}x slower than"
            say(f"ectier {word} {rel} safetensors-per-item (seconds per byte)")
    if base["load_s"] > 0 and base["hit_bytes"]:
        say(f"by tier: host hits {_fmt_gbps(ect['get_host_gbps'])} ({ect['host_hits']}), NVMe hits "
            f"{_fmt_gbps(ect['get_nvme_gbps'])} ({ect['nvme_hits']}); baseline "
            f"{_fmt_gbps(base['hit_bytes'] / base['load_s'] / 1e9)}")
        note("an NVMe hit is read, checksummed and placed in the host tier before the consumer's copy "
             "(two passes over memory); the baseline maps its page-cached file (one pass, no check): "
             "docs/benchmarks.md, `ectier demo`")
    say("load, both sides: the connector's load, then every byte copied into one")
    note("warm buffer (what vLLM's gather does); ectier: a lease + zero-copy view of the host arena "
         "(an NVMe hit decoded straight into its host slot); baseline: load_file (a lazy map of the "
         "file in the page cache)")
    say(f"baseline: {base['hits']} hits / {base['misses']} misses (unbounded disk, never evicts); "
        f"{base['mismatches']} mismatches")
    say("both stores served each request back to back, in alternating order;")
    note("both sides' page cache is warm")


def _by_size_table(rows: list[dict[str, Any]]) -> Table:
    t = _table("load by entry size, GB/s; loads: host+NVMe hits (both sides touch every byte)")
    # loads: host + NVMe hits; host, NVMe: GB/s of the loads each tier served; ectier: all of them
    for col in ("entry", "loads", "host", "NVMe", "ectier", "safetensors", "speed-up"):
        t.add_column(col, justify="right")
    labels = [format_bytes(r["nbytes"]) for r in rows]
    for r, label in zip(rows, labels):
        if labels.count(label) > 1:  # two sizes that round alike: more digits for them
            label = f"{r['nbytes'] / (1 << 20):.3f} MiB"
        t.add_row(label, f"{r.get('host_loads', 0)}+{r.get('nvme_loads', 0)}", _fmt_gbps(r.get("host_gbps")),
                  _fmt_gbps(r.get("nvme_gbps")), _fmt_gbps(r["ectier_gbps"]),
                  _fmt_gbps(r["baseline_gbps"]), f"{r['speedup']:.2f}x")
    return t


def _tier_wins(rows: list[dict[str, Any]], tier: str) -> str | None:
    """"9 of 10": of the sizes where ``tier`` served loads (and the baseline loaded too), how
    many its GB/s beat the baseline's at (None: no such size)."""
    both = [r for r in rows if r.get(f"{tier}_gbps") and r["baseline_gbps"]]
    if not both:
        return None
    wins = sum(r[f"{tier}_gbps"] > r["baseline_gbps"] for r in both)
    return f"{wins} of {len(both)}"


def print_summary(summary: dict[str, Any], console: Console) -> None:
    """Render a :func:`ectier.demo.run_demo` summary (the dict, or its JSON read back) on ``console``.

    Tables fit in :data:`TABLE_WIDTH` (80) columns; text lines fold on narrower consoles.
    """
    ect = summary["ectier"]
    _header(summary, console)
    console.print(_images_table(summary))
    console.print(_tiers_table(ect))
    for line in _tier_flags(ect):
        console.print(f"[yellow]{line}[/]", highlight=False)
    console.print(_results_table(summary))
    if summary["baseline"] is not None:
        _baseline(summary, console)
    ok = summary["ok"]
    console.print(
        f"[bold {'green' if ok else 'red'}]{'OK' if ok else 'FAIL'}[/]: {summary['mismatches']} mismatches; "
        f"total {_fmt_s(summary['wall_s'])}",
        highlight=False,
    )
