"""Output of ``ectier bench``: JSON, markdown tables, rich tables on the console, PNG plots (Agg).

Plots need matplotlib (the ``demo`` and ``bench`` extras bring it). Without it every ``plot_*``
raises :class:`PlotsUnavailable`; :func:`try_plot` turns that into a one-line reason, so a command
still writes its JSON and markdown (they are written before any plot).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Sequence

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

__all__ = ["write_json", "markdown_table", "print_table", "fmt", "plot_curve", "plot_tiers", "plot_crossover",
           "plot_baseline", "PlotsUnavailable", "try_plot"]

#: What to install for the plots.
PLOT_HINT = "pip install 'ectier[bench]' (or 'ectier[demo]')"


class PlotsUnavailable(ImportError):
    """matplotlib cannot be imported; the message says what to install."""


def try_plot(plot: Callable[..., None], *args: Any, **kwargs: Any) -> str | None:
    """Call ``plot(*args, **kwargs)``; None once it wrote its file, else the reason it could not
    (matplotlib missing: :class:`PlotsUnavailable`'s message). Other errors propagate."""
    try:
        plot(*args, **kwargs)
    except PlotsUnavailable as exc:
        return str(exc)
    return None


def fmt(v: Any, kind: str = "") -> str:
    """Format a cell: ``kind`` in ``pct`` (0..1 -> %), ``ms`` (seconds -> ms), ``s``, ``gb`` (bytes -> GB),
    ``gbps``; None -> ``-``."""
    if v is None:
        return "-"
    if kind == "pct":
        return f"{100 * v:.1f} %"
    if kind == "ms":
        return f"{1e3 * v:.2f}"
    if kind == "s":
        return f"{v:.2f}"
    if kind == "gb":
        return f"{v / 1e9:.2f}"
    if kind == "gbps":
        return f"{v:.2f}"
    return str(v)


def write_json(data: Any, path: str | os.PathLike) -> None:
    """Write ``data`` as indented JSON (creating the parent directory)."""
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.write("\n")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def print_table(console: Console, title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print a rich table (right-aligned numbers). One wider than the console is printed turned
    (a row per column) when it has fewer rows than columns; cells fold rather than lose digits."""
    t = _table(title, headers, rows)
    natural = Measurement.get(console, console.options.update(max_width=1 << 16), t).maximum
    if natural > console.width and len(rows) < len(headers) - 1:
        turned = [[h, *[str(r[i]) for r in rows]] for i, h in enumerate(headers) if i]
        t = _table(None, [str(headers[0]), *[str(r[0]) for r in rows]], turned)
        console.print(title, soft_wrap=False, highlight=False, markup=False)  # (as wide as the console)
    console.print(t)


def _table(title: str | None, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    t = Table(title=title, title_justify="left")
    for i, h in enumerate(headers):
        t.add_column(h, justify="left" if i == 0 else "right", overflow="fold")
    for r in rows:
        t.add_row(*[str(c) for c in r])
    return t


def _plt():
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotsUnavailable(f"matplotlib is not installed ({exc}); plots skipped ({PLOT_HINT})") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curve(curve: list[dict[str, Any]], path: str | os.PathLike, subtitle: str = "") -> None:
    """Hit rate (items) and encoder time saved vs total budget, one line per policy."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), dpi=80)
    for pol in sorted({c["policy"] for c in curve}):
        pts = sorted(((c["host_bytes"] + c["nvme_bytes"], c) for c in curve if c["policy"] == pol),
                     key=lambda p: p[0])
        x = [p[0] / 1e9 for p in pts]
        axes[0].plot(x, [p[1]["hit_rate"] for p in pts], marker="o", label=pol)
        axes[1].plot(x, [p[1]["saved_fraction"] for p in pts], marker="o", label=pol)
    axes[0].set_ylabel("hit rate (items)")
    axes[1].set_ylabel("encoder time saved (fraction)")
    for a in axes:
        a.set_xlabel("host + NVMe budget (GB)")
        a.set_ylim(0, 1)
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle("replay: hit rate vs capacity " + subtitle, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_tiers(rows: list[dict[str, Any]], path: str | os.PathLike) -> None:
    """GB/s vs entry size, one line per (tier, op, impl)."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), dpi=80)
    for ax, ops in zip(axes, (("put", "d2h"), ("get", "h2d"))):
        for key in sorted({(r["tier"], r["op"], r["impl"]) for r in rows if r["op"] in ops}):
            pts = sorted((r["num_tokens"], r["gbps"] or 0) for r in rows if (r["tier"], r["op"], r["impl"]) == key)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    linestyle="-" if key[2] == "ectier" else "--", label=f"{key[0]} {key[2]}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N tokens (entry = N x 16 KiB)")
        ax.set_ylabel("GB/s")
        ax.set_title("/".join(ops), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_crossover(cross: dict[str, Any], cost_points: list[tuple[int, float]], path: str | os.PathLike,
                   cost_label: str) -> None:
    """Load time per tier vs recompute time, against N."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=80)
    for tier, d in cross.items():
        ax.plot([p[0] for p in d["points"]], [p[1] * 1e3 for p in d["points"]], marker="o", label=f"load {tier}")
    ax.plot([p[0] for p in cost_points], [p[1] * 1e3 for p in cost_points], color="k", label="recompute")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("N tokens")
    ax.set_ylabel("ms")
    ax.set_title(f"load vs recompute ({cost_label})", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_baseline(stores: list[dict[str, Any]], path: str | os.PathLike, comparison: dict[str, Any]) -> None:
    """Per store: encoder seconds still spent + cache I/O seconds (stacked), and the ratio to recomputing
    everything; the title says whether both come from this machine (``comparison["like_with_like"]``)."""
    plt = _plt()
    names = [r["policy"] if "host_bytes" not in r else f"ectier {r['policy']}" for r in stores]
    enc = [r["encoder_spent_s"] for r in stores]
    io = [r["get_s"] + r["put_s"] for r in stores]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), dpi=80)
    y = list(range(len(stores)))
    axes[0].barh(y, enc, label="encoder (misses)")
    axes[0].barh(y, io, left=enc, label="cache I/O")
    axes[0].set_xlabel("seconds")
    axes[0].legend(fontsize=7)
    ratios = [r["ratio_vs_recompute"] or 0.0 for r in stores]
    axes[1].barh(y, ratios, color="grey")
    axes[1].axvline(1.0, color="k", linewidth=0.8)
    axes[1].set_xlim(0, 1.3 * max(ratios + [1.0]))
    axes[1].set_xlabel("encoder + I/O vs recompute (x)")
    for ax in axes:
        ax.set_yticks(y)
        ax.set_yticklabels(names if ax is axes[0] else [""] * len(y), fontsize=7)
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
    for i, r in enumerate(ratios):
        axes[1].text(r, i, f" {r:.3g}x", va="center", fontsize=7)
    kind = "like with like (this machine)" if comparison["like_with_like"] else "NOT like with like (two machines)"
    fig.suptitle(f"baseline: {kind}\nencoder: {comparison['encoder_seconds']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
