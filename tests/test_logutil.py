"""Rate-limited warnings (ectier.logutil): one line per kind per interval, with a count."""

from __future__ import annotations

import logging

import pytest

from ectier.logutil import RateLimitedLogger


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def lines(caplog):
    caplog.set_level(logging.WARNING, logger="ectier.test.logutil")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "ectier.test.logutil"]


def test_a_hundred_failures_are_one_line_then_one_line_with_the_count(lines):
    clock = FakeClock()
    rl = RateLimitedLogger(logging.getLogger("ectier.test.logutil"), 10.0, clock=clock)
    for i in range(100):
        rl.warning("lookup", "ectier: lookup for %s failed; treated as a miss", f"h{i}")
        clock.now += 0.05  # 100 events in 5 s
    assert lines() == ["ectier: lookup for h0 failed; treated as a miss"]
    assert rl.suppressed("lookup") == 99
    clock.now = 1000.0 + 10.0
    assert rl.warning("lookup", "ectier: lookup for %s failed; treated as a miss", "h100")
    assert lines()[1:] == ["ectier: lookup for h100 failed; treated as a miss (99 more like this in the last 10 s)"]
    assert rl.suppressed("lookup") == 0
    clock.now += 10.0  # nothing suppressed since: no count
    rl.warning("lookup", "ectier: lookup for %s failed; treated as a miss", "h101")
    assert lines()[2] == "ectier: lookup for h101 failed; treated as a miss"


def test_kinds_are_independent_and_levels_are_kept(caplog):
    caplog.set_level(logging.INFO, logger="ectier.test.logutil")
    clock = FakeClock()
    rl = RateLimitedLogger(logging.getLogger("ectier.test.logutil"), 10.0, clock=clock)
    assert rl.warning(("save", "OSError"), "save %d", 1)
    assert rl.warning(("save", "TimeoutError"), "save %d", 2)
    assert not rl.warning(("save", "OSError"), "save %d", 3)
    assert rl.log(logging.INFO, "info-kind", "note")
    assert rl.log(15, "custom", "custom level")  # no named method: Logger.log
    got = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "ectier.test.logutil"]
    assert got == [(logging.WARNING, "save 1"), (logging.WARNING, "save 2"), (logging.INFO, "note")]


def test_lines_go_through_the_loggers_own_method(monkeypatch):
    """Callers that replace ``logger.warning`` (as the vLLM suite does) still see every line."""
    logger = logging.getLogger("ectier.test.logutil.patched")
    seen = []
    monkeypatch.setattr(logger, "warning", lambda fmt, *args: seen.append(fmt % args))
    clock = FakeClock()
    rl = RateLimitedLogger(logger, 1.0, clock=clock)
    rl.warning("k", "a %s", "x")
    rl.warning("k", "a %s", "y")
    clock.now += 2.4
    rl.warning("k", "a %s", "z")
    assert seen == ["a x", "a z (1 more like this in the last 2 s)"]


@pytest.mark.parametrize("bad", [0, -1, True, "10", None])
def test_interval_must_be_positive(bad):
    with pytest.raises(ValueError, match="interval_s"):
        RateLimitedLogger(logging.getLogger("x"), bad)


def test_kinds_are_remembered_up_to_a_bound_oldest_forgotten_first():
    from ectier.logutil import MAX_KINDS

    log = logging.getLogger("ectier.test.logutil.bound")
    clock = [0.0]
    limiter = RateLimitedLogger(log, 10.0, clock=lambda: clock[0])
    for i in range(MAX_KINDS + 5):
        assert limiter.warning(("kind", i), "event %d", i)
    assert limiter.warning(("kind", MAX_KINDS + 4), "again") is False  # the newest is still remembered
    assert limiter.warning(("kind", 0), "again") is True  # the oldest was forgotten: written anew


def test_failure_kind_leaves_out_numbers_and_quoted_parts():
    from ectier.logutil import failure_kind

    assert failure_kind(OSError(5, "Input/output error")) == failure_kind(OSError(5, "Input/output error"))
    a = failure_kind(ValueError("entry 'k1' of 1048576 bytes failed"))
    assert a == failure_kind(ValueError("entry 'k22' of 65536 bytes failed"))
    assert a != failure_kind(ValueError("entry 'k1' of 1048576 bytes changed"))
    assert failure_kind(ValueError("x"))[0] != failure_kind(TypeError("x"))[0]
