"""Turn ectier benchmark results into ratio tables (ectier GB/s / reference GB/s).

Used two ways:

- by ``benchmarks/conftest.py``: at the end of a ``pytest benchmarks`` run the tables are printed
  in the terminal summary (and written as Markdown when ``--bench-report=PATH`` is given);
- on its own, from a pytest-benchmark JSON file::

      .venv/bin/python -m pytest benchmarks -p no:cacheprovider --benchmark-only --benchmark-json=bench.json
      .venv/bin/python benchmarks/report.py bench.json            # Markdown tables on stdout

Every benchmark records, in ``benchmark.extra_info``:

``suite``      ``host`` | ``nvme`` | ``codec``
``tokens``     N, the encoder output is ``(N, 8192)`` bfloat16
``entry_bytes``  N * 8192 * 2
``op``         what one call does (``put+get``, ``put``, ``get``, ``write``, ``read``, ``encode``, ...)
``impl``       ``ectier ...`` or the name of the reference (``torch copy_ x2``, ``file write+fsync``, ...)
``role``       ``ectier``, ``reference`` or ``diagnostic``
``bytes_per_call``  bytes one call moves (2 x entry for put+get); GB/s = bytes_per_call / time
``compare``    (ectier rows) the references to divide by, the first one carries the goal
``compression_ratio``  (codec rows) raw bytes / stored bytes

GB/s are decimal (1e9 bytes/s). ``ratio`` uses the **median** time of both sides (separate
benchmarks, one after the other); ``ratio (best)`` the minimum times; ``ratio (paired)`` is the
median of per-round ratios from an interleaved run of both sides (``role == "paired"`` results,
``extra_info["paired_ratios"]``), the figure least disturbed when the machine's load changes during
the run (interleaving also makes both sides share the caches, so on a quiet machine it can sit
below the median ratio). The goal verdict uses the median ratio, flagged ``(loaded)`` when other
processes took more than 5 % of the CPU meanwhile.
``other load`` is the highest share of the machine's CPU that other processes took while the
benchmarks behind a row ran (``extra_info["other_load"]``); figures measured above a few percent
are not to be quoted.

Standard library only: importable without the project's dependencies.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Any, Iterable

GOAL = 0.80
LOADED = 0.05  # other processes' CPU share above which a figure is flagged
MiB = 1 << 20


@dataclass
class Result:
    """One finished benchmark: its extra_info and timing (seconds per call)."""

    info: dict[str, Any]
    median_s: float
    min_s: float
    rounds: int = 0
    name: str = ""

    @property
    def suite(self) -> str:
        return self.info["suite"]

    @property
    def tokens(self) -> int:
        return int(self.info["tokens"])

    @property
    def gbps(self) -> float:
        return self.info["bytes_per_call"] / self.median_s / 1e9

    @property
    def gbps_best(self) -> float:
        return self.info["bytes_per_call"] / self.min_s / 1e9


@dataclass
class RatioRow:
    suite: str
    tokens: int
    entry_bytes: int
    op: str
    impl: str
    gbps: float
    reference: str
    ref_gbps: float
    ratio: float
    ratio_best: float
    goal: float | None  # None: informational comparison
    ratio_paired: float | None = None  # median of per-round ratios, interleaved run
    load: float = 0.0  # highest share of CPU other processes took while the rows' benchmarks ran

    @property
    def decisive(self) -> float:
        """The ratio the goal is judged on: the median ratio (separate, cache-warm benchmarks)."""
        return self.ratio

    @property
    def verdict(self) -> str:
        if self.goal is None:
            return "info"
        word = "MET" if self.decisive >= self.goal else "MISSED"
        return word + (" (loaded)" if self.load > LOADED else "")


@dataclass
class Tables:
    ratios: list[RatioRow] = field(default_factory=list)
    codecs: list[Result] = field(default_factory=list)
    all_results: list[Result] = field(default_factory=list)


def from_benchmark_json(path: str) -> tuple[list[Result], dict[str, Any]]:
    """Results and machine info from a ``--benchmark-json`` file."""
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    out = []
    for b in data.get("benchmarks", []):
        info = b.get("extra_info") or {}
        if "suite" not in info:
            continue
        st = b["stats"]
        out.append(Result(info, float(st["median"]), float(st["min"]), int(st.get("rounds", 0)), b.get("name", "")))
    return out, data.get("machine_info", {}).get("ectier", {})


def build(results: Iterable[Result]) -> Tables:
    """Pair every ectier result with the references it names (same suite, same N)."""
    results = list(results)
    tables = Tables(all_results=results)
    by_key = {(r.suite, r.tokens, r.info["impl"]): r for r in results if r.info.get("role") != "paired"}
    paired = {}
    loads = {}
    for r in results:
        if r.info.get("role") == "paired":
            loads[(r.suite, r.tokens, r.info["impl"])] = r.info.get("other_load", 0.0)
            for ref_name, ratio in r.info["paired_ratios"].items():
                paired[(r.suite, r.tokens, r.info["impl"], ref_name)] = ratio
    for r in results:
        if r.suite == "codec":
            tables.codecs.append(r)
            continue
        if r.info.get("role") != "ectier":
            continue
        for i, ref_name in enumerate(r.info.get("compare", [])):
            ref = by_key.get((r.suite, r.tokens, ref_name))
            if ref is None:
                continue  # reference skipped (e.g. no O_DIRECT on this filesystem)
            tables.ratios.append(
                RatioRow(
                    suite=r.suite,
                    tokens=r.tokens,
                    entry_bytes=int(r.info["entry_bytes"]),
                    op=r.info["op"],
                    impl=r.info["impl"],
                    gbps=r.gbps,
                    reference=ref_name,
                    ref_gbps=ref.gbps,
                    ratio=r.gbps / ref.gbps,
                    ratio_best=r.gbps_best / ref.gbps_best,
                    goal=GOAL if (i == 0 and r.info.get("goal")) else None,
                    ratio_paired=paired.get((r.suite, r.tokens, r.info["impl"], ref_name)),
                    load=max(r.info.get("other_load", 0.0), ref.info.get("other_load", 0.0),
                             loads.get((r.suite, r.tokens, r.info["impl"]), 0.0)),
                )
            )
    order = {"host": 0, "nvme": 1}
    tables.ratios.sort(key=lambda x: (order.get(x.suite, 9), x.tokens))
    tables.codecs.sort(key=lambda x: (x.tokens, x.info["codec"], x.info["op"]))
    return tables


# ------------------------------------------------------------------------------------ rendering


def _size(row_bytes: int) -> str:
    return f"{row_bytes / MiB:g} MiB"


def _ratio_table(rows: list[RatioRow], md: bool) -> list[str]:
    head = ["N", "entry", "ectier op", "ectier GB/s", "reference", "ref GB/s", "ratio", "ratio (best)",
            "ratio (paired)", "goal >= 80 %", "other load"]
    body = [
        [
            str(r.tokens),
            _size(r.entry_bytes),
            r.impl,
            f"{r.gbps:.2f}",
            r.reference,
            f"{r.ref_gbps:.2f}",
            f"{100 * r.ratio:.0f} %",
            f"{100 * r.ratio_best:.0f} %",
            f"{100 * r.ratio_paired:.0f} %" if r.ratio_paired is not None else "-",
            r.verdict,
            f"{100 * r.load:.0f} %",
        ]
        for r in rows
    ]
    return _grid(head, body, md)


def _codec_table(rows: list[Result], md: bool) -> list[str]:
    head = ["N", "entry", "codec", "op", "MB/s", "MB/s (best)", "compression ratio", "other load"]
    body = []
    for r in rows:
        cr = r.info.get("compression_ratio")
        body.append(
            [
                str(r.tokens),
                _size(int(r.info["entry_bytes"])),
                r.info["codec"],
                r.info["op"],
                f"{r.gbps * 1000:.0f}",
                f"{r.gbps_best * 1000:.0f}",
                f"{cr:.3f}" if cr else "-",
                f"{100 * r.info.get('other_load', 0.0):.0f} %",
            ]
        )
    return _grid(head, body, md)


def _grid(head: list[str], body: list[list[str]], md: bool) -> list[str]:
    if md:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return lines
    widths = [max(len(h), *(len(row[i]) for row in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*row) for row in body]


TITLES = {
    "host": "Host tier: cache.put + cache.get vs plain memory copies of the same bytes",
    "nvme": "NVMe tier (host capacity 0): cache.put / cache.get vs raw file I/O of the same bytes",
}


def render(tables: Tables, *, md: bool = False, machine: dict[str, Any] | None = None) -> str:
    lines: list[str] = []
    h = "### " if md else "== "
    if machine:
        lines.append(f"{h}machine")
        lines += [f"- {k}: {v}" for k, v in machine.items()]
        lines.append("")
    for suite in ("host", "nvme"):
        rows = [r for r in tables.ratios if r.suite == suite]
        if not rows:
            continue
        lines.append(h + TITLES[suite])
        lines.append("")
        lines += _ratio_table(rows, md)
        lines.append("")
    if tables.codecs:
        lines.append(h + "Codecs on torch.randn(N, 8192).bfloat16() bytes (one thread)")
        lines.append("")
        lines += _codec_table(tables.codecs, md)
        lines.append("")
    primary = [r for r in tables.ratios if r.goal is not None]
    if primary:
        missed = [r for r in primary if r.verdict.startswith("MISSED")]
        lines.append(
            f"goal >= {GOAL:.0%} of the reference: {len(primary) - len(missed)} of {len(primary)} met"
            + (": missed " + ", ".join(f"{r.suite} {r.impl} N={r.tokens} ({r.decisive:.0%})" for r in missed) if missed else "")
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ machine


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def filesystem_of(path: str) -> str:
    """``"ext4 on /dev/vda (mounted at /)"`` for the mount holding ``path`` (Linux /proc/mounts)."""
    path = os.path.realpath(path)
    best = None
    for line in _read("/proc/mounts").splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        dev, mnt, fstype = parts[0], parts[1].replace("\\040", " "), parts[2]
        if path == mnt or path.startswith(mnt.rstrip("/") + "/"):
            if best is None or len(mnt) > len(best[1]):
                best = (dev, mnt, fstype)
    return f"{best[2]} on {best[0]} (mounted at {best[1]})" if best else "unknown"


def cpu_snapshot() -> tuple[float, float, float]:
    """``(busy_s, total_s, own_s)``: CPU seconds of the whole machine (all CPUs, from /proc/stat)
    and of this process, to tell afterwards how much CPU *other* processes took during the run."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = total = 0.0
    for line in _read("/proc/stat").splitlines():
        if line.startswith("cpu "):
            v = [int(x) for x in line.split()[1:]]
            idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
            total = sum(v[:8]) / tick  # guest time is already counted in user
            busy = total - idle / tick
            break
    t = os.times()
    return busy, total, t.user + t.system


def contention(start: tuple[float, float, float], end: tuple[float, float, float]) -> dict[str, Any]:
    """CPU taken by other processes between two :func:`cpu_snapshot` calls."""
    busy, total, own = (e - s for s, e in zip(start, end))
    others = max(0.0, busy - own)
    return {"wall CPU-seconds": round(total, 1), "this run": round(own, 1), "other processes": round(others, 1),
            "other processes share": f"{100 * others / total:.0f} %" if total > 0 else "?"}


def other_load(start: tuple[float, float, float], end: tuple[float, float, float]) -> float:
    """Share of the machine's CPU (0..1) taken by other processes between two snapshots."""
    busy, total, own = (e - s for s, e in zip(start, end))
    return max(0.0, busy - own) / total if total > 0 else 0.0


def machine_info(bench_dir: str | None = None) -> dict[str, Any]:
    cpu = "unknown"
    for line in _read("/proc/cpuinfo").splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = "unknown"
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith("MemTotal"):
            mem = f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
            break
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "memory": mem,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "transparent_hugepage": _read("/sys/kernel/mm/transparent_hugepage/enabled").strip() or "unknown",
    }
    for mod in ("torch", "numpy", "lmdb", "zstandard", "xxhash"):
        m = sys.modules.get(mod)
        if m is not None:
            info[mod] = getattr(m, "__version__", getattr(m, "VERSION", "?"))
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch threads"] = torch.get_num_threads()
    if bench_dir:
        info["bench dir"] = bench_dir
        info["bench dir filesystem"] = filesystem_of(bench_dir)
    return info


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.split("\n\n")[0])
        print("usage: report.py BENCH.json [MORE.json ...]  (written by --benchmark-json; several runs,\n"
              "       e.g. one per suite, are merged, a later file's result replacing an earlier one's)",
              file=sys.stderr)
        return 2
    merged: dict[tuple, Result] = {}
    machine: dict[str, Any] = {}
    for path in argv[1:]:
        results, info = from_benchmark_json(path)
        machine = machine or info
        for r in results:
            merged[(r.suite, r.tokens, r.info["impl"], r.info.get("role"), r.info["op"])] = r
    print(render(build(merged.values()), md=True, machine={k: v for k, v in machine.items() if k != "cpu contention"}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
