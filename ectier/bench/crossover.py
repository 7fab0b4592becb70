"""Crossover: the entry size (N tokens) at which loading from a tier stops beating recomputing.

Load time per tier is the measured ``get`` p50 of ``ectier`` rows of :func:`ectier.bench.tiers.measure_tiers`
(``gpu`` rows: the ``h2d`` op; ``remote`` rows: :func:`ectier.bench.remote_rows.measure_remote`), interpolated linearly between measured N (and extrapolated from the
last two points up to ``max_tokens``); recompute time is the :class:`CostModel`. The crossover is the
smallest N on a dense grid where ``load(N) >= recompute(N)``; ``None`` = "never within range".
Load rows that :mod:`ectier.bench.noise` flagged ``noisy`` are listed per tier (``noisy_tokens``)
and named in the verdict: a crossover from them is not to be trusted.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .costmodel import CostModel

__all__ = ["crossover"]


def crossover(tier_rows: list[dict[str, Any]], cost: CostModel, *, min_tokens: int = 64,
              max_tokens: int = 16384) -> dict[str, Any]:
    """Per tier: measured points, model points and the crossover N (or None, "never within range").

    Args:
        tier_rows: ``rows`` of :func:`~ectier.bench.tiers.measure_tiers`.
        cost: the recompute cost model.
        min_tokens, max_tokens: the N range searched (Qwen3-VL: 64..16384).

    Returns:
        ``{tier: {"points": [[N, load_s, recompute_s], ...], "crossover_tokens": int | None,
        "verdict": str, "noisy_tokens": [N, ...]}}`` for each tier with at least one ``ectier`` load
        row (``noisy_tokens``: the N whose load row is flagged ``noisy``).
    """
    out: dict[str, Any] = {}
    for tier, op in (("host", "get"), ("nvme", "get"), ("gpu", "h2d"), ("remote", "get")):
        mine = [r for r in tier_rows if r["tier"] == tier and r["op"] == op and r["impl"] == "ectier"]
        pts = sorted((r["num_tokens"], r["p50_s"]) for r in mine)
        noisy = sorted(r["num_tokens"] for r in mine if r.get("noisy"))
        if not pts:
            continue
        ns = np.array([p[0] for p in pts], dtype=float)
        ts = np.array([p[1] for p in pts], dtype=float)
        grid = np.unique(np.geomspace(min_tokens, max_tokens, 256).round())
        if len(ns) == 1:
            load = ts[0] * grid / ns[0]  # proportional to bytes
        else:
            load = np.interp(grid, ns, ts)
            hi = grid > ns[-1]
            slope = (ts[-1] - ts[-2]) / (ns[-1] - ns[-2])
            load[hi] = ts[-1] + slope * (grid[hi] - ns[-1])
            lo = grid < ns[0]
            load[lo] = ts[0]
        rec = np.array([cost.seconds(int(n)) for n in grid])
        worse = np.nonzero(load >= rec)[0]
        n_x = int(grid[worse[0]]) if len(worse) else None
        verdict = (f"loading stops winning at N = {n_x} tokens" if n_x is not None
                   else f"never within range (loading wins for all N in {min_tokens}..{max_tokens})")
        if (n_x is None or n_x > ns[-1]) and ns[-1] < max_tokens:  # (it was stated as measured)
            verdict += f" (load measured up to N = {int(ns[-1])}, extrapolated above it)"
        if noisy:
            verdict += f" (NOISY load rows at N = {', '.join(map(str, noisy))}: unreliable)"
        out[tier] = {"points": [[int(n), float(t), cost.seconds(int(n))] for n, t in pts],
                     "crossover_tokens": n_x, "verdict": verdict, "noisy_tokens": noisy,
                     "extrapolated_above_tokens": int(ns[-1])}
    return out
