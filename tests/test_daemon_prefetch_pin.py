"""``prefetch`` with ``pin``: process-held leases for the keys in the arena, granted key by key
within the view bounds (``daemon.view_pin_bytes``), refusals counted; a request naming a bad key
pins nothing. And :meth:`TieredCache.acquire_many`, the arena lookup behind it.
Every daemon is a real process (tests/daemon_helpers.py)."""

from __future__ import annotations

import os

import pytest
import torch

from daemon_helpers import (KiB, MiB, DaemonProcess, daemon_config, daemon_stats, make_tensor, remove_dir,
                            short_tmpdir, write_config)
from ectier import TieredCache
from ectier.config import CacheConfig
from ectier.daemon.client import DaemonClient
from ectier.errors import InvalidKeyError

ITEM = (64, 8192)  # bfloat16: 1 MiB


@pytest.fixture
def pin_daemon():
    d = short_tmpdir()
    cfg = daemon_config(d, host_bytes=16 * MiB, block_bytes=256 * KiB, nvme=False, view_pin_bytes=2 * MiB)
    proc = DaemonProcess(write_config(os.path.join(d, "daemon.json"), cfg), cfg["daemon"]["socket_path"]).start()
    yield proc
    proc.stop()
    remove_dir(d)


def _views(proc: DaemonProcess) -> dict:
    return daemon_stats(proc.socket_path)["daemon"]["views"]


def test_pins_are_granted_in_order_within_view_pin_bytes(pin_daemon):
    with DaemonClient(pin_daemon.socket_path) as c:
        for i in range(3):
            c.put(f"k{i}", make_tensor(i, "bfloat16", ITEM), namespace="test")
        keys = ["k0", "k1", "k2", "nobody"]
        r = c.call("prefetch", keys=keys, namespace="test", pin=["k0", "k0", "k1", "k2", "nobody"], direct=True)
        assert r["states"] == ["ready", "ready", "ready", "absent"]
        p0, again, p1, p2, none = r["pins"]
        # a key named twice is pinned once: its repeat is null (the same lease handed out twice
        # would be released by the first view to die, under the second)
        assert again is None and none is None
        assert p2 is None, "a third 1 MiB view passes daemon.view_pin_bytes=2 MiB"
        assert [p0["dtype"], p0["shape"], p0["nbytes"]] == ["bfloat16", list(ITEM), MiB]
        assert p0["extents"] and all(len(e) == 2 for e in p0["extents"]) and p0["lease"] != p1["lease"]
        v = _views(pin_daemon)
        assert (v["leases"], v["bytes"], v["granted"], v["refused"]) == (2, 2 * MiB, 2, 2)  # k2 refused, and again once the prefetcher answers it ready
        # a key the process already views costs nothing more: granted past the bound's edge
        r2 = c.call("prefetch", keys=["k1", "k2"], namespace="test", pin=["k1", "k2"], direct=True)
        assert r2["pins"][0] is not None and r2["pins"][1] is None
        inst = c.server_info["instance"]
        leases = [p0["lease"], p1["lease"], r2["pins"][0]["lease"]]
        assert c.call("release", leases=leases, instance=inst) == {"released": 3}
        v = _views(pin_daemon)
        assert (v["leases"], v["bytes"], v["released"], v["refused"]) == (0, 0, 3, 4)


def test_a_pin_list_with_a_bad_key_is_an_error_and_pins_nothing(pin_daemon):
    with DaemonClient(pin_daemon.socket_path) as c:
        c.put("k0", make_tensor(0, "bfloat16", ITEM), namespace="test")
        with pytest.raises(Exception, match="key"):
            c.call("prefetch", keys=["k0"], namespace="test", pin=["k0", ""], direct=True)
        v = _views(pin_daemon)
        assert (v["leases"], v["bytes"], v["granted"]) == (0, 0, 0), "a lease its client never learnt of"


def test_acquire_many_pins_what_the_host_arena_holds_and_counts_it():
    cfg = CacheConfig.from_dict({"namespace": "t", "host": {"capacity_bytes": 4 * MiB, "block_bytes": 64 * KiB,
                                                            "pin_memory": False}})
    with TieredCache(cfg) as cache:
        a, b = torch.arange(1000, dtype=torch.int32), torch.ones(70 * KiB, dtype=torch.uint8)
        cache.put("a", a)
        cache.put("b", b)
        hits = cache.stats()["hits"]
        la, miss, lb = cache.acquire_many(["a", "zz", "b"])
        assert miss is None and la.meta.key == "a" and lb.meta.nbytes == 70 * KiB
        assert torch.equal(cache.load(la), a) and torch.equal(cache.load(lb), b)
        assert cache.stats()["hits"] == hits + 2
        with pytest.raises(InvalidKeyError):
            cache.acquire_many(["a", ""])
        cache.release(la)
        cache.release(lb)
        assert cache.delete("a") and cache.acquire_many(["a"]) == [None]
        assert cache.acquire_many([]) == []
