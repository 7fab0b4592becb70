"""A call run on a thread of its own while a test stages the moment it races with (shared by the
race tests): :func:`start` it, then :func:`join` it (its result, or its exception re-raised)."""

from __future__ import annotations

import threading
from typing import Any, Callable


def start(fn: Callable[..., Any], *args: Any, name: str | None = None) -> tuple[threading.Thread, dict]:
    """Run ``fn(*args)`` on a new thread; returns the thread and the box its outcome lands in."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised by join
            box["error"] = exc

    t = threading.Thread(target=run, name=name)
    t.start()
    return t, box


def join(t: threading.Thread, box: dict, timeout_s: float = 30.0) -> Any:
    """Wait for a :func:`start` ed call (``timeout_s`` seconds, else AssertionError): its return
    value, or its exception raised here."""
    t.join(timeout_s)
    assert not t.is_alive(), "staged thread stuck"
    if "error" in box:
        raise box["error"]
    return box.get("value")
