"""Rate-limited logging: one line per kind of event per interval, with a count of the rest.

A failure that repeats per item and per step (a daemon that is down, a disk that is full) would
otherwise write one WARNING per item: hundreds of lines per second at production rates.
:class:`RateLimitedLogger` writes the first event of a kind at once, counts the ones that follow
within ``interval_s``, and appends that count to the next line of the same kind written after the
interval::

    ectier: lookup for h1 failed (DaemonUnavailableError: ...); treated as a miss
    ectier: lookup for h9 failed (DaemonUnavailableError: ...); treated as a miss (99 more like this in the last 10 s)

The lines go through the wrapped :class:`logging.Logger`'s own methods (``logger.warning`` and
so on, looked up at each call), so handlers, filters and levels apply as usual.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any, Callable

__all__ = ["RateLimitedLogger", "failure_kind"]

#: kinds remembered at most (the oldest is forgotten first): messages that vary more than their
#: numbers and quoted parts cannot grow the state without bound
MAX_KINDS = 1024
_DETAILS = re.compile(r"'[^']*'|\"[^\"]*\"|\d+")


def failure_kind(exc: object) -> tuple[str, str]:
    """A kind for :meth:`RateLimitedLogger.log` from an exception (or any object): its type and
    its message with the numbers and quoted parts left out, so one failure of many entries is one
    kind (``[Errno 5] ...`` of any entry) and another cause (an LMDB map full, a checksum) another."""
    return type(exc).__name__, _DETAILS.sub("", str(exc))[:120]


class RateLimitedLogger:
    """Write at most one line per ``kind`` per ``interval_s`` to ``logger``.

    Args:
        logger: where the lines go.
        interval_s: seconds during which further events of a kind after a written line are only
            counted (float > 0; default 10).
        clock: monotonic time source in seconds (tests inject a fake one).

    Raises:
        ValueError: ``interval_s`` is not a positive number.

    Thread-safe. ``kind`` is any hashable naming the event (e.g. ``("lookup", "TimeoutError")``);
    events of different kinds never suppress each other.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s > 0:
            raise ValueError(f"interval_s: expected a positive number of seconds, got {interval_s!r}")
        self.logger = logger
        self.interval_s = float(interval_s)
        self._clock = clock
        self._lock = threading.Lock()
        # kind -> [time of the last written line, events suppressed since]
        self._state: dict[Any, list] = {}

    def log(self, level: int, kind: Any, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` at ``level`` unless a line of ``kind`` was written less than
        ``interval_s`` ago (then only count it). Returns True if a line was written."""
        now = self._clock()
        with self._lock:
            state = self._state.get(kind)
            if state is not None and now - state[0] < self.interval_s:
                state[1] += 1
                return False
            suppressed, since = (state[1], now - state[0]) if state is not None else (0, 0.0)
            self._state.pop(kind, None)
            self._state[kind] = [now, 0]  # (last in order: the oldest line's kind is first)
            if len(self._state) > MAX_KINDS:
                del self._state[next(iter(self._state))]
        if suppressed:
            msg = f"{msg} (%d more like this in the last %.0f s)"
            args = (*args, suppressed, since)
        method = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning",
                  logging.ERROR: "error", logging.CRITICAL: "critical"}.get(level)
        if method is None:
            self.logger.log(level, msg, *args)
        else:
            getattr(self.logger, method)(msg, *args)
        return True

    def warning(self, kind: Any, msg: str, *args: Any) -> bool:
        """:meth:`log` at WARNING."""
        return self.log(logging.WARNING, kind, msg, *args)

    def suppressed(self, kind: Any) -> int:
        """Events of ``kind`` counted but not written since its last line."""
        with self._lock:
            state = self._state.get(kind)
            return 0 if state is None else state[1]
