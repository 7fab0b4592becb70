"""``scripts/gpu_suite.sh`` and ``benchmarks/gpu_suite.py`` on a machine without CUDA: the parts a
GPU machine runs first, exercised with the CUDA pieces stood in for, so that the one call on a GPU
box cannot fail for a trivial reason (a name, an import, an argument)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
