"""The daemon's caps on pinned arena bytes count whole arena blocks, so pins leave room for puts.

An entry smaller than ``host.block_bytes`` still occupies a whole block of the arena. The caps
on what the daemon pins (the prefetcher's held pins: half the arena; zero-copy views:
``daemon.view_pin_bytes`` / ``daemon.view_pin_total_bytes``) count each pinned entry as
``ceil(nbytes / block_bytes)`` blocks, so many small entries cannot pin the whole arena; and when
views and prefetch pins together leave no unpinned room, prefetch pins give way to a put instead
of it waiting ``host.admit_wait_s`` for room that never comes.

Each test puts 128 small entries (4000 bytes: one 64 KiB block each) that fill an 8 MiB arena,
pins them, then times a put: it must return well within ``host.admit_wait_s`` (2 s here). Every
daemon is a real process (tests/daemon_helpers.py).
"""

from __future__ import annotations

import time

from daemon_helpers import KiB, MiB, assert_same, daemon_process, daemon_stats, make_tensor, wait_for
from ectier.daemon.client import DaemonClient

ARENA, BLOCK = 8 * MiB, 64 * KiB
BLOCKS = ARENA // BLOCK  # 128
HALF = ARENA // 2  # the prefetch cap, and the default view caps
ADMIT_WAIT_S = 2.0
SMALL = (2000,)  # bfloat16: 4000 bytes, one block


def daemon(**kw):
    """A daemon of an ``ARENA``-byte arena in ``BLOCK``-byte blocks, ``host.admit_wait_s`` ``ADMIT_WAIT_S``."""
    return daemon_process(host_bytes=ARENA, block_bytes=BLOCK,
                          edit=lambda cfg: cfg["host"].update(admit_wait_s=ADMIT_WAIT_S), **kw)


def fill(c: DaemonClient) -> dict[str, object]:
    """Put BLOCKS small entries (the whole arena, one block each); returns them by key."""
    items = {f"k{i}": make_tensor(i, "bfloat16", SMALL) for i in range(BLOCKS)}
    for k, t in items.items():
        c.put(k, t)
    return items


def prefetch_all(c: DaemonClient, keys: list[str]) -> None:
    """``prefetch`` ``keys`` five at a time, each batch until it is no longer promoting."""
    for i in range(0, len(keys), 5):
        batch = keys[i:i + 5]
        wait_for(lambda: "promoting" not in c.prefetch(batch), timeout=30, what="a prefetch batch")


def timed_put(c: DaemonClient, key: str) -> float:
    t = make_tensor(999, "bfloat16", (200,))  # 400 bytes
    t0 = time.monotonic()
    c.put(key, t)
    seconds = time.monotonic() - t0
    assert_same(c.get(key), t)
    return seconds


def test_prefetch_pins_count_whole_blocks_and_a_put_after_them_is_quick():
    with daemon() as proc, DaemonClient(proc.socket_path, timeout_s=30) as c:
        fill(c)
        prefetch_all(c, [f"k{i}" for i in range(BLOCKS)])
        p = daemon_stats(proc.socket_path)["daemon"]["prefetch"]
        seconds = timed_put(c, "after")
    # held_bytes counts the blocks the held pins occupy: at most half the arena
    assert p["held_bytes"] == p["held"] * BLOCK and 0 < p["held_bytes"] <= HALF, p
    assert seconds < ADMIT_WAIT_S / 2, f"the put took {seconds:.2f} s: it waited for unpinned arena room"


def test_view_pins_count_whole_blocks_and_a_put_after_them_is_quick():
    with daemon() as proc, DaemonClient(proc.socket_path, timeout_s=30) as c:
        items = fill(c)
        views = [c.get_view(k) for k in items]  # kept: every one pins its entry while alive
        v = daemon_stats(proc.socket_path)["daemon"]["views"]
        seconds = timed_put(c, "after")
        for got, k in zip(views, items):
            assert_same(got, items[k])  # refused ones are copies
        del views
    assert v["bytes"] == v["leases"] * BLOCK, v  # one block per small entry
    assert 0 < v["bytes"] <= HALF and v["refused"] == BLOCKS - v["leases"], v
    assert seconds < ADMIT_WAIT_S / 2, f"the put took {seconds:.2f} s: it waited for unpinned arena room"


def test_views_and_prefetch_pins_together_leave_a_put_quick():
    """Views up to their cap and prefetch pins up to theirs pin the whole arena between them: a
    put then ends a prefetch pin (its entry stays in the arena, unpinned) instead of waiting for
    room, and is readable."""
    with daemon() as proc, DaemonClient(proc.socket_path, timeout_s=30) as c:
        items = fill(c)
        keys = list(items)
        views = [c.get_view(k) for k in keys[:BLOCKS // 2]]
        prefetch_all(c, keys[BLOCKS // 2:])
        d = daemon_stats(proc.socket_path)["daemon"]
        seconds = timed_put(c, "after")
        yielded = daemon_stats(proc.socket_path)["daemon"]["prefetch"].get("yielded")
        del views
    assert seconds < ADMIT_WAIT_S / 2, f"the put took {seconds:.2f} s: it waited for unpinned arena room"
    assert d["views"]["bytes"] <= HALF and d["prefetch"]["held_bytes"] <= HALF, d
    assert d["views"]["bytes"] + d["prefetch"]["held_bytes"] == ARENA, d  # the whole arena pinned...
    assert yielded == 1  # ...so one prefetch pin gave way to the put
