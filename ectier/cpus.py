"""How many CPUs this process may use, and how many background promotions that leaves room for.

:func:`usable_cpus` is the smaller of the CPUs the process may run on (its affinity mask, or every
CPU where the platform has no affinity call) and its cgroup v2 CPU quota (``cpu.max``: a container
limited to 2 CPUs on a 64-core node can use 2). :func:`background_threads` sizes the prefetch
pool from it (``prefetch_threads``; docs/operations.md).
"""

from __future__ import annotations

import math
import os

__all__ = ["usable_cpus", "background_threads"]

CGROUP_CPU_MAX = "/sys/fs/cgroup/cpu.max"


def usable_cpus(cpu_max_path: str = CGROUP_CPU_MAX) -> int:
    """CPUs this process may use (at least 1): its affinity, capped by a cgroup v2 quota."""
    affinity = getattr(os, "sched_getaffinity", None)
    n = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    try:
        with open(cpu_max_path) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota readable: the affinity alone
    return max(1, n)


def background_threads(configured: int | None) -> int:
    """``configured`` (``prefetch_threads``), or for ``None`` 1 where :func:`usable_cpus` is 4 or
    fewer, else 2. On a 2-vCPU machine two promotions at once took both cores from a co-located
    engine's scheduler (docs/benchmarks.md, "Daemon mode: background promotions keep to one core
    on a small machine")."""
    if configured is not None:
        return configured
    return 1 if usable_cpus() <= 4 else 2

