"""``scripts/gpu_suite.sh`` and ``benchmarks/gpu_suite.py`` on a machine without CUDA: the parts a
GPU machine runs first, exercised with the CUDA pieces stood in for, so that the one call on a GPU
box cannot fail for a trivial reason (a name, an import, an argument)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import ectier
from ectier import testing
from ectier.copy import InlineCopyEngine

ROOT = Path(__file__).resolve().parents[1]

#: a ``python3`` whose torch "has CUDA" (the script's first question), that answers the script's
#: check of ectier's dependencies from a bare interpreter (``-S``: nothing imported by ``.pth``
#: files, as on a GPU box's own Python) and runs the suite itself with the real interpreter
FAKE_PYTHON = """#!/bin/sh
case "$1" in
  -c) exit 0 ;;
  -m) exit 0 ;;
  -) PYTHONPATH="$SUITE_SITE${PYTHONPATH:+:$PYTHONPATH}" exec "$SUITE_REAL" -S - ;;
  *) exec "$SUITE_REAL" "$@" ;;
esac
"""


def test_gpu_suite_sh_checks_dependencies_in_a_bare_interpreter(tmp_path):
    """Before: the dependency check did ``import importlib`` and called ``importlib.util``, which
    only exists once something imported it (here a ``.pth`` file does; a plain venv does not):
    AttributeError, and ``set -e`` ended the script with a traceback, exit 1."""
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    site = os.pathsep.join(dict.fromkeys((sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])))
    env = {**os.environ, "PYTHON": str(fake), "SUITE_REAL": sys.executable, "SUITE_SITE": site}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_suite.sh"), "--check"], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr and "lacks" not in r.stderr, r.stderr
    assert r.returncode == 0, r.stderr
    assert "gpu_suite:" in r.stdout  # the suite ran (without CUDA here: it says so)


def test_gpu_suite_sh_is_valid_bash():
    r = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_suite.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# ----------------------------------------------------- the benchmarks, with CUDA stood in for


class _Stream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Event(_Stream):
    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.001


class _TorchWithFakeCuda(type(torch)):
    """What ``import torch`` inside the suite's functions gets: torch, with ``cuda`` stood in for,
    every device the CPU, and ``pin_memory`` ignored (a CPU build has no pinned allocator)."""

    def __getattr__(self, name):
        return getattr(torch, name)


def _fake_torch():
    shim = _TorchWithFakeCuda("torch")
    shim.cuda = type(torch)("torch.cuda")
    shim.cuda.__dict__.update(
        Stream=_Stream, Event=_Event, stream=lambda s: contextlib.nullcontext(), current_stream=lambda d=None: _Stream(),
        synchronize=lambda d=None: None, set_device=lambda d: None, get_device_name=lambda d=None: "stand-in",
        empty_cache=lambda: None, is_available=lambda: True, device_count=lambda: 1)
    shim.device = lambda d: torch.device("cpu")

    def on_cpu(fn):
        return lambda *a, pin_memory=False, device=None, **k: fn(*a, **k)

    shim.empty, shim.randint = on_cpu(torch.empty), on_cpu(torch.randint)
    return shim


class _OnTheStandIn:
    """A test cache (copies inline, the GPU tier's arena in CPU memory) whose reads onto
    ``cuda:<i>`` go to that stand-in."""

    def __init__(self, cfg) -> None:
        cfg = dataclasses.replace(cfg, host=dataclasses.replace(cfg.host, pin_memory=None))
        self.cache = testing.make_cache(cfg, copy_engine=InlineCopyEngine(), gpu_device="cpu")

    def get(self, key, device=None, **kwargs):
        return self.cache.get(key, device="cpu", **kwargs)

    def __contains__(self, key) -> bool:
        return key in self.cache

    def __getattr__(self, name):
        return getattr(self.cache, name)


def test_gpu_suite_benchmarks_run_end_to_end_with_cuda_stood_in_for(monkeypatch, capsys):
    """Every benchmark function of the suite, called as ``main`` calls them, and the table: a
    name, an import or an argument that is wrong fails here, not on the GPU machine."""
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    monkeypatch.setattr(ectier, "TieredCache", _OnTheStandIn)
    monkeypatch.setitem(sys.modules, "torch", _fake_torch())
    bench = suite.bench("cuda:0", [1], total_mib=2, reps=1)
    monkeypatch.setitem(sys.modules, "torch", torch)
    assert set(bench["sizes"]["1MiB"]) >= {"save_GBps", "load_GBps", "overlap_GBps", "raw_overlap_GBps",
                                            "put_host_us_median", "put_host_us_p90"}
    assert bench["gpu_hit"]["gpu_hits"] >= 50
    text = suite.table({"device": bench["device"], "tests": {"returncode": 0, "summary": "1 passed"}, "bench": bench})
    assert "GPU-tier hit, 16 MiB" in text and "1MiB" in text


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
