"""What the remote-tier benchmarks share (``remote_mooncake_bench.py``, ``remote_redis_bench.py``,
``remote_latency_bench.py``): sizes given in MiB (:func:`mib_list`), the share of the machine's
CPU that other processes took while one measured (:func:`measured`), the facts of the machine
(:func:`machine_base`), and the printed report with its optional JSON (:func:`report`)."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

MiB = 1 << 20


def mib_list(text: str) -> list[int]:
    """Bytes of each comma-separated size in MiB (``"16,64"``, ``"0.5,1"``; empty items skipped)."""
    return [int(float(s) * MiB) for s in text.split(",") if s.strip()]


def _jiffies(pids: list[int]) -> tuple[int, int, int]:
    """(busy jiffies of the machine, all its jiffies, busy jiffies of ``pids``)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # minus idle and iowait
    own = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
            own += int(parts[11]) + int(parts[12])  # utime, stime
    return busy, sum(fields), own


def measured(pids: list[int], fn: Callable[[], Any]) -> tuple[Any, float]:
    """``(fn(), other load)``: the share (0..1) of the machine's CPU time during ``fn`` taken by
    processes other than this one and ``pids`` (its servers)."""
    pids = [os.getpid(), *pids]
    busy0, all0, own0 = _jiffies(pids)
    out = fn()
    busy1, all1, own1 = _jiffies(pids)
    return out, max(0, (busy1 - busy0) - (own1 - own0)) / max(1, all1 - all0)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """``(wall seconds, fn())``."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def machine_base() -> dict[str, str]:
    """``date`` (UTC, minutes), ``cpu`` (model and count), ``python``."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": f"{cpu}, {os.cpu_count()} CPUs", "python": platform.python_version()}


def report(info: dict[str, Any], line: str, body: str, json_path: str | None, data: dict[str, Any]) -> int:
    """Print the machine facts, ``line`` (the run: rounds, other load) and ``body`` (the tables);
    with ``json_path`` also write ``{"machine": info, **data}`` there. Returns 0 (the exit status)."""
    print("\n".join(f"- {k}: {v}" for k, v in info.items()))
    print(line + "\n")
    print(body)
    if json_path:
        Path(json_path).write_text(json.dumps({"machine": info, **data}, indent=1))
    return 0
