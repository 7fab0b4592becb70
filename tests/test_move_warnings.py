"""A failure that repeats per entry is logged once per kind per 10 s, with a count of the rest
(``ectier.logutil.RateLimitedLogger``): a disk that fails every write, a store that is down. It
used to be one WARNING per entry, hundreds of lines per second at a serving engine's rates, which
reached vLLM's log through the connector."""

from __future__ import annotations

import errno
import logging

from conftest import KiB, filled
from ectier import testing

BLK = 64 * KiB


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("ectier")]


def test_demotions_failing_on_every_entry_are_one_line(make_cache, caplog):
    cache, _ = make_cache(host_bytes=2 * BLK, write_behind_fraction=0)  # each put demotes the oldest
    cache.put("k0", filled(BLK, 0))
    cache.put("k1", filled(BLK, 1))
    caplog.set_level(logging.WARNING, logger="ectier")
    with testing.fail_writes(cache, "nvme", OSError(errno.EIO, "injected EIO")) as calls:
        for i in range(2, 22):
            cache.put(f"k{i}", filled(BLK, i))
    assert len(calls) >= 20
    assert cache.stats()["tiers"]["host"]["drops"] >= 20  # every victim was dropped...
    lines = _warnings(caplog)
    assert 1 <= len(lines) <= 2, lines  # ...and said once (one line per kind of failure)
    assert "EIO" in lines[0] or "Input/output error" in lines[0], lines


def test_another_cache_still_gets_its_own_first_line(make_cache, tmp_path, caplog):
    """The limit is per cache: one cache's flood does not hide another cache's first failure."""
    caplog.set_level(logging.WARNING, logger="ectier")
    seen = []
    for n in range(2):
        cache, _ = make_cache(path=tmp_path / f"nvme{n}", host_bytes=2 * BLK, write_behind_fraction=0)
        cache.put("a", filled(BLK, 0))
        cache.put("b", filled(BLK, 1))
        with testing.fail_writes(cache, "nvme", OSError(errno.EIO, "injected EIO")):
            cache.put("c", filled(BLK, 2))
        seen.append(len(_warnings(caplog)))
    assert seen[0] >= 1 and seen[1] > seen[0], seen


def test_different_causes_of_one_error_type_are_separate_lines(make_cache, caplog):
    """An LMDB map at its ceiling (a setting to raise) and a failing disk are both a
    ``TierWriteError``: the first cause's line used to hide the second for the whole interval."""
    from ectier.errors import TierWriteError

    cache, _ = make_cache(host_bytes=2 * BLK, write_behind_fraction=0)
    cache.put("k0", filled(BLK, 0))
    cache.put("k1", filled(BLK, 1))
    caplog.set_level(logging.WARNING, logger="ectier")
    causes = [TierWriteError("nvme tier: LMDB map is at its ceiling (nvme.max_map_bytes=1048576)"),
              TierWriteError("nvme tier: payload write failed under '/x': [Errno 5] Input/output error")]
    n = 2
    for exc in causes:
        with testing.fail_writes(cache, "nvme", exc):
            for _ in range(5):
                cache.put(f"k{n}", filled(BLK, n))
                n += 1
    lines = _warnings(caplog)
    assert len(lines) == 2, lines
    assert "ceiling" in lines[0] and "Input/output error" in lines[1], lines
