"""``ectier bench connectors``: the numbers of vLLM EC connectors driven through vLLM's calls.

The driving (vLLM imports) is :mod:`.connector_driver`; this module is pure Python over
its results: how many items each size gets, medians and p90 per metric, ratios against vLLM's
``ECExampleConnector``, the table, the verdict and the plot (matplotlib, optional).

A *sample* is one item's timings, seconds: ``save_block_s`` (inside ``save_caches``),
``save_calls_s`` (plus the completion calls until the save is reported), ``loadable_s`` (save
start until reported), ``lookup_s`` (``ensure_cache_available`` steps until ``has_cache_item``),
``load_s`` (``start_load_caches`` plus touching every byte), ``consumer_s`` (the whole consumer
side).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["BASELINE", "DEFAULT_SIZES", "METRICS", "reps_for", "summarize", "table", "verdict", "plot_connectors"]

DEFAULT_SIZES = (64, 1024, 2040, 4096)
#: the variant every ratio is taken against
BASELINE = "example"
#: the issue's goal for the worker's time blocked in save_caches + the save's completion calls (CPU)
SAVE_GOAL_S = 100e-6
#: (sample key, column title)
METRICS = (
    ("save_block_s", "save_caches"),
    ("save_calls_s", "save + completion calls"),
    ("loadable_s", "until loadable"),
    ("lookup_s", "lookup"),
    ("load_s", "load (bytes touched)"),
    ("consumer_s", "whole consumer"),
)


def reps_for(nbytes: int, budget_bytes: int, *, min_reps: int = 5, max_reps: int = 30) -> int:
    """Items per (variant, N): about ``budget_bytes`` moved, at least ``min_reps``, at most ``max_reps``.

    Raises:
        ValueError: ``nbytes`` or ``budget_bytes`` not positive, or ``min_reps`` > ``max_reps``.
    """
    if nbytes <= 0 or budget_bytes <= 0:
        raise ValueError(f"reps_for: nbytes and budget_bytes must be > 0, got {nbytes}, {budget_bytes}")
    if not 1 <= min_reps <= max_reps:
        raise ValueError(f"reps_for: need 1 <= min_reps <= max_reps, got {min_reps}, {max_reps}")
    return max(min_reps, min(max_reps, budget_bytes // nbytes))


def _quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile ``q`` in [0, 1] of a non-empty list (numpy's default method)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (variant, N) row of :func:`.connector_driver.run_variant` results: for each
    metric ``<key>`` the median ``<key>_p50`` and ``<key>_p90`` (seconds) and, where the baseline ran
    at the same N, ``<key>_vs_example`` = baseline median / this median (> 1: faster than
    ``ECExampleConnector``). Skipped results pass through with their ``skipped`` reason."""
    rows = []
    for r in results:
        row = {k: r[k] for k in ("variant", "num_tokens") if k in r}
        if "skipped" in r:
            rows.append({**row, "skipped": r["skipped"]})
            continue
        row.update(nbytes=r["nbytes"], reps=r["reps"], mismatches=r["mismatches"])
        for key, _ in METRICS:
            vals = [s[key] for s in r["samples"]]
            row[f"{key}_p50"], row[f"{key}_p90"] = _quantile(vals, 0.5), _quantile(vals, 0.9)
        row["lookup_steps_max"] = max(s["lookup_steps"] for s in r["samples"])
        rows.append(row)
    base = {r["num_tokens"]: r for r in rows if r["variant"] == BASELINE and "skipped" not in r}
    for row in rows:
        b = base.get(row.get("num_tokens"))
        if b is None or "skipped" in row:
            continue
        for key, _ in METRICS:
            mine = row[f"{key}_p50"]
            row[f"{key}_vs_example"] = b[f"{key}_p50"] / mine if mine > 0 else None
    return rows


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Headers and cells: ms as ``p50 / p90``; ``vs example`` = ECExampleConnector's median / this one's."""
    headers = ["connector", "N", "MiB", "items"] + [f"{t} ms" for _, t in METRICS] + \
              ["consumer vs example", "save vs example", "bitwise"]
    cells = []
    for r in rows:
        if "skipped" in r:
            continue
        cells.append([r["variant"], str(r["num_tokens"]), f"{r['nbytes'] / (1 << 20):.1f}", str(r["reps"])]
                     + [f"{_ms(r[f'{k}_p50'])} / {_ms(r[f'{k}_p90'])}" for k, _ in METRICS]
                     + [_x(r.get("consumer_s_vs_example")), _x(r.get("save_block_s_vs_example")),
                        "ok" if r["mismatches"] == 0 else f"{r['mismatches']} MISMATCHES"])
    return headers, cells


def verdict(rows: list[dict[str, Any]]) -> list[str]:
    """One line per non-baseline variant: at which N its whole consumer side beats ECExampleConnector's
    (median) and its worker time blocked saving against the 100 us goal; the skipped variants with
    their reasons."""
    lines, by = [], {}
    for r in rows:
        by.setdefault(r["variant"], []).append(r)
    for name, rs in by.items():
        skipped = [r for r in rs if "skipped" in r]
        if skipped:
            lines.append(f"{name}: skipped ({skipped[0]['skipped']})")
            continue
        if name == BASELINE:
            continue
        faster = [r["num_tokens"] for r in rs if (r.get("consumer_s_vs_example") or 0) > 1]
        slower = [r["num_tokens"] for r in rs if r.get("consumer_s_vs_example") is not None
                  and r["consumer_s_vs_example"] <= 1]
        if not faster and not slower:
            continue
        text = (f"{name}: whole consumer side faster than ECExampleConnector at N = {_list(faster)}" if faster
                else f"{name}: whole consumer side faster than ECExampleConnector at no N")
        if slower:
            text += f"; not faster at N = {_list(slower)}"
        blocked = [r["save_calls_s_p50"] * 1e6 for r in rs]
        lo, hi = f"{min(blocked):.0f}", f"{max(blocked):.0f}"
        spread = lo if lo == hi else f"{lo}-{hi}"
        text += (f"; worker blocked saving p50 {spread} us per item "
                 f"(goal <= {SAVE_GOAL_S * 1e6:.0f} us on CPU: {'met' if max(blocked) <= SAVE_GOAL_S * 1e6 else 'NOT met'})")
        lines.append(text)
    bad = [r for r in rows if r.get("mismatches")]
    if bad:
        lines.append("BITWISE MISMATCHES: " + ", ".join(f"{r['variant']} N={r['num_tokens']}" for r in bad))
    return lines


def _list(ns: list[int]) -> str:
    return ", ".join(map(str, ns)) if ns else "none"


def plot_connectors(rows: list[dict[str, Any]], path: str) -> None:
    """Two panels over N (log-log): whole consumer side p50 and worker time blocked saving
    (``save_caches`` + completion calls) p50, one line per connector (matplotlib required: :class:`~ectier.bench.report.PlotsUnavailable` without it)."""
    from .report import _plt

    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (("consumer_s_p50", "whole consumer side p50 (ms)"), ("save_calls_s_p50", "worker blocked saving p50 (ms)"))
    names = list(dict.fromkeys(r["variant"] for r in rows if "skipped" not in r))
    for ax, (key, title) in zip(axes, panels):
        for name in names:
            pts = sorted((r["num_tokens"], r[key] * 1e3) for r in rows if r["variant"] == name and "skipped" not in r)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name,
                    linestyle="--" if name == BASELINE else "-")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("N (tokens; entry = N x 8192 bf16)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
