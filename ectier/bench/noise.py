"""Is a timed measurement trustworthy? Noise detection for ``ectier bench tiers`` (and crossover).

A measurement is a list of repeat times (seconds). It is **noisy** when any of these holds
(thresholds in :class:`NoiseThresholds`):

- **spread**: ``p90 / p50`` above ``max_spread`` - the repeats disagree;
- **disturbed median**: ``p50 / min`` above ``max_p50_over_min`` - the fastest repeat shows what
  the operation costs, and the typical one was several times slower (descheduled, e.g. p50s
  landing on 4 ms scheduler steps while a clean repeat took 0.05 ms);
- **other load**: other processes used more than ``max_other_cpu`` of the machine's CPU time
  while it ran (from ``/proc/stat`` minus this process's own CPU time; unknown where
  ``/proc/stat`` is missing or the window was too short to tell);
- **below the physical floor**: slower than a floor the caller knows the hardware beats (the
  host memcpy reference: ``min_reference_gbps``).

:func:`measure_until_quiet` repeats a noisy measurement up to ``retries`` times and keeps the
cleanest attempt; what is still noisy after that is flagged (``noisy: true`` with the reasons),
never silently used.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

__all__ = ["NoiseThresholds", "CpuProbe", "assess", "measure_until_quiet", "noise_summary"]


@dataclass(frozen=True)
class NoiseThresholds:
    """When a measurement counts as noisy (see the module docstring).

    Fields:
        max_spread: largest ``p90 / p50`` of the repeats (ratio).
        max_p50_over_min: largest ``p50 / min`` (ratio).
        max_other_cpu: largest share of the machine's CPU time (0..1, all cores) that other
            processes may use while it runs.
        min_reference_gbps: host memcpy slower than this (GB/s, 1e9 bytes) cannot be the hardware.
    """

    max_spread: float = 2.0
    max_p50_over_min: float = 3.0
    max_other_cpu: float = 0.5
    min_reference_gbps: float = 1.0

    def to_dict(self) -> dict[str, float]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


def _read_proc_stat() -> Optional[tuple[int, int]]:
    """(busy ticks, total ticks) over all CPUs since boot, or None without ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    total = sum(ticks)
    return total - ticks[3] - ticks[4], total


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class CpuProbe:
    """Share of the machine's CPU time (0..1, all cores) that *other* processes used in a window.

    Args:
        read_stat: returns ``(busy_ticks, total_ticks)`` summed over all CPUs, or None (default:
            ``/proc/stat``); injectable for tests.
        own_cpu_s: this process's CPU seconds, user + system (default: :func:`os.times`).
        ticks_per_s: clock ticks per second of ``read_stat`` (default: ``SC_CLK_TCK``).
        min_ticks: windows shorter than this many ticks (all CPUs together) give None: too short to tell.
    """

    def __init__(self, read_stat: Callable[[], Optional[tuple[int, int]]] = _read_proc_stat,
                 own_cpu_s: Callable[[], float] = _own_cpu_s, ticks_per_s: Optional[float] = None,
                 min_ticks: int = 10) -> None:
        self._read, self._own, self.min_ticks = read_stat, own_cpu_s, min_ticks
        if ticks_per_s is None:
            ticks_per_s = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
        self.ticks_per_s = ticks_per_s
        self._start: Optional[tuple[tuple[int, int], float]] = None

    def start(self) -> None:
        """Open a window."""
        stat = self._read()
        self._start = (stat, self._own()) if stat is not None else None

    def stop(self) -> Optional[float]:
        """Close the window: other processes' share of all CPU time in it, or None (unknown)."""
        if self._start is None:
            return None
        (busy0, total0), own0 = self._start
        self._start = None
        stat = self._read()
        if stat is None:
            return None
        busy, total = stat[0] - busy0, stat[1] - total0
        if total <= 0 or total < self.min_ticks:
            return None
        own = (self._own() - own0) * self.ticks_per_s
        return float(min(1.0, max(0.0, (busy - own) / total)))


def assess(times: Sequence[float], other_cpu: Optional[float] = None,
           thresholds: NoiseThresholds = NoiseThresholds(), *, max_p50_s: Optional[float] = None) -> dict[str, Any]:
    """Judge one measurement.

    Args:
        times: repeat times in seconds (at least one, each >= 0).
        other_cpu: :meth:`CpuProbe.stop`'s share while it ran, or None (unknown: not judged).
        thresholds: the limits.
        max_p50_s: a physical floor: a median slower than this many seconds is noise (None: none).

    Returns:
        ``{"spread_p90_p50", "p50_over_min", "other_cpu", "noisy": bool, "reasons": [str]}``
        (ratios None where the min or p50 is 0).

    Raises:
        ValueError: ``times`` is empty.
    """
    if len(times) == 0:
        raise ValueError("times: need at least one repeat")
    arr = np.asarray(times, dtype=float)
    p50, p90, lo = float(np.median(arr)), float(np.percentile(arr, 90)), float(arr.min())
    spread = p90 / p50 if p50 > 0 else None
    disturbed = p50 / lo if lo > 0 else None
    reasons = []
    if spread is not None and spread > thresholds.max_spread:
        reasons.append(f"spread p90/p50 {spread:.1f} > {thresholds.max_spread:g}")
    if disturbed is not None and disturbed > thresholds.max_p50_over_min:
        reasons.append(f"p50/min {disturbed:.1f} > {thresholds.max_p50_over_min:g}")
    if other_cpu is not None and other_cpu > thresholds.max_other_cpu:
        reasons.append(f"other processes used {other_cpu:.0%} of the CPU > {thresholds.max_other_cpu:.0%}")
    if max_p50_s is not None and p50 > max_p50_s:
        reasons.append(f"p50 {p50 * 1e3:.3g} ms slower than the physical floor {max_p50_s * 1e3:.3g} ms")
    return {"spread_p90_p50": spread, "p50_over_min": disturbed, "other_cpu": other_cpu,
            "noisy": bool(reasons), "reasons": reasons}


def measure_until_quiet(attempt: Callable[[], list[float]], *, probe: Optional[CpuProbe] = None,
                        thresholds: NoiseThresholds = NoiseThresholds(), retries: int = 2,
                        max_p50_s: Optional[float] = None) -> tuple[list[float], dict[str, Any]]:
    """Run ``attempt()`` (one measurement: a list of repeat times) until it is not noisy, at most
    ``1 + retries`` times; keep the first clean attempt, else the one with the fewest reasons (then
    the lowest median).

    Returns:
        ``(times, noise)``: the kept attempt's times and :func:`assess`'s dict for it plus
        ``attempts`` (how many ran).

    Raises:
        ValueError: ``retries`` < 0. Whatever ``attempt`` raises propagates.
    """
    if retries < 0:
        raise ValueError(f"retries: must be >= 0, got {retries}")
    best: Optional[tuple[tuple[int, float], list[float], dict[str, Any]]] = None
    n = 0
    for n in range(1, retries + 2):
        if probe is not None:
            probe.start()
        times = attempt()
        other = probe.stop() if probe is not None else None
        verdict = assess(times, other, thresholds, max_p50_s=max_p50_s)
        rank = (len(verdict["reasons"]), float(np.median(times)))
        if best is None or rank < best[0]:
            best = (rank, times, verdict)
        if not verdict["noisy"]:
            break
    assert best is not None
    return best[1], {**best[2], "attempts": n}


def noise_summary(rows: Sequence[dict[str, Any]], run_other_cpu: Optional[float] = None,
                  thresholds: NoiseThresholds = NoiseThresholds()) -> Optional[str]:
    """One warning line for the rows still flagged ``noisy`` (and a busy machine over the whole
    run), or None when the run looks clean. Rows: ``tier, op, impl, num_tokens, noise``."""
    bad = [r for r in rows if r.get("noisy")]
    parts = []
    if bad:
        names = ", ".join(f"{r['tier']} {r['op']} {r['impl']} N={r['num_tokens']}" for r in bad[:4])
        more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
        parts.append(f"{len(bad)} of {len(rows)} rows still noisy after retries ({names}{more}; "
                     f"first: {'; '.join(bad[0]['noise']['reasons'])})")
    if run_other_cpu is not None and run_other_cpu > thresholds.max_other_cpu:
        parts.append(f"other processes used {run_other_cpu:.0%} of the CPU during the run")
    if not parts:
        return None
    return ("NOISY RUN: " + "; ".join(parts)
            + ". Figures (and a crossover from them) are unreliable: rerun on a quiet machine.")

