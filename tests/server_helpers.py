"""What the test servers' helpers share (``tests/mooncake_master.py``, ``tests/redis_cluster.py``,
``tests/netns.py``): skip a test whose servers cannot be had, or fail it on CI
(:func:`unavailable`), once an install of what they need failed (:func:`ensure_installed`, once per
process); install Debian packages (:func:`apt_install`); pick a free
loopback port (:func:`free_port`); tie a server process's life to the test process
(:func:`die_with_parent`, a ``preexec_fn``); call until servers answer again (:func:`eventually`)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["unavailable", "ensure_installed", "apt_install", "free_port", "die_with_parent", "eventually", "wait_stopped"]


def unavailable(what: str, reason: str) -> None:
    """Skip the test that needs ``what`` (e.g. ``"Mooncake tests"``) for ``reason``; on CI
    (``CI=true``) fail it instead: there every test must run."""
    import pytest  # here: the helpers also serve scripts and benchmarks

    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{what} must run on CI: {reason}")
    pytest.skip(reason)


_installs: dict[str, str] = {}  # what -> "" once installed, else why it cannot be


def ensure_installed(what: str, install: Callable[[], str]) -> None:
    """Run ``install`` (it makes the tools of ``what`` available: '' or why not) the first time
    it is asked for ``what`` in this process; while that failed, :func:`unavailable` with why."""
    if what not in _installs:
        _installs[what] = install()
    if _installs[what]:
        unavailable(what, _installs[what])


def apt_install(packages: list[str]) -> str:
    """``apt-get update`` then ``apt-get install -y`` Debian's ``packages``: '' once done, else why
    not (not root, no apt-get, a command that failed or ran past 600 s)."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"{', '.join(packages)} not installable here (needs root and apt-get)"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *packages]):
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{' '.join(cmd)} failed: {exc}"
        if done.returncode != 0:
            return f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-500:]}"
    return ""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In the child (a ``preexec_fn``): SIGKILL when the test process dies, even by a crash that
    skips teardown (``PR_SET_PDEATHSIG``)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def eventually(fn: Callable[[], Any], errors: tuple[type[BaseException], ...], within_s: float) -> Any:
    """``fn()``, called again every 0.2 s while it raises one of ``errors``, for ``within_s``
    seconds; then the last error propagates."""
    end = time.monotonic() + within_s
    while True:
        try:
            return fn()
        except errors:
            if time.monotonic() > end:
                raise
            time.sleep(0.2)


def wait_stopped(pid: int, within_s: float = 10.0) -> None:
    """Wait until every thread of ``pid`` is in state T (stopped); RuntimeError after ``within_s``."""
    end = time.monotonic() + within_s
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):
                continue  # a thread that just ended
        if states and all(st in ("T", "t") for st in states):
            return
        if time.monotonic() > end:
            raise RuntimeError(f"process {pid} not stopped {within_s:g} s after SIGSTOP: thread states {states}")
        time.sleep(0.005)
