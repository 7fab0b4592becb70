"""The length of a host put's and get's path (issue 12, item 7): every Python function a call runs
costs ~1 us more after the 1 MiB copy it makes than on warm caches (docs/benchmarks.md, "The 1 MiB
fixed cost"), so the number of Python calls one ``put`` / ``get`` of a host entry runs is bounded
here. Counted with ``sys.setprofile`` (no timing), on a host-only cache, one key overwritten as a
stream of puts would.
"""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from conftest import MiB
from ectier import PutHandle, TieredCache
from ectier.config import CacheConfig, HostTierConfig, NvmeTierConfig
from ectier.errors import TierWriteError

#: Python calls of one put of a CPU tensor into the host tier (41 before issue 12 item 7's cut)
PUT_CALLS = 24
#: Python calls of one host hit, ``get`` or ``get(out=)`` (31 before)
GET_CALLS = 26


def _python_calls(fn) -> list[str]:
    calls: list[str] = []

    def profile(frame, event, _arg):
        if event == "call":
            calls.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")

    # no garbage collection inside: its callbacks (hypothesis registers one) and weakref
    # finalizers ran as Python calls of the counted one, 7 more in one CI run
    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return calls[1:]  # (fn itself)


@pytest.fixture
def entry():
    return torch.randn(64, 8192).bfloat16()  # 1 MiB, N=64


@pytest.fixture
def cache(entry):
    with TieredCache(CacheConfig(host=HostTierConfig(capacity_bytes=4 * MiB, pin_memory=False))) as c:
        for _ in range(3):  # both slots a stream of overwrites alternates between have their typed view
            c.put("img", entry)
        yield c


def test_a_host_put_runs_a_short_path(cache, entry):
    calls = _python_calls(lambda: cache.put("img", entry))
    assert len(calls) <= PUT_CALLS, f"a host put ran {len(calls)} Python calls (bound {PUT_CALLS}): {calls}"
    assert torch.equal(cache.get("img"), entry)
    assert cache.stats()["tiers"]["host"]["puts"] == 4 and len(cache) == 1


@pytest.mark.parametrize("with_out", [False, True], ids=["get", "get(out=)"])
def test_a_host_hit_runs_a_short_path(cache, entry, with_out):
    out = torch.empty_like(entry) if with_out else None
    got: list = []
    calls = _python_calls(lambda: got.append(cache.get("img", out=out)))
    assert len(calls) <= GET_CALLS, f"a host get ran {len(calls)} Python calls (bound {GET_CALLS}): {calls}"
    assert torch.equal(got[0], entry) and (got[0] is out if with_out else True)


def test_a_synchronous_put_hands_back_a_stored_handle(cache, entry):
    h = PutHandle.stored("k")
    assert h.done() and h.wait(0) and h.error is None and h.key == "k" and "stored" in repr(h)
    got = cache.put("img", entry)
    assert isinstance(got, PutHandle) and got.done() and got.wait(0) and got.error is None


def test_a_put_the_free_blocks_cannot_take_still_evicts_or_goes_below(tmp_path, entry):
    """The short path reserves from the free blocks only; without them a put evicts as before, and
    with every entry pinned it lands in the tier below (or fails naming the host tier)."""
    host = HostTierConfig(capacity_bytes=2 * MiB, pin_memory=False, admit_wait_s=0.01)
    cfg = CacheConfig(host=host, nvme=NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=64 * MiB))
    with TieredCache(cfg) as c:
        for k in "abc":
            c.put(k, entry + ord(k))
        assert c.stats()["tiers"]["host"]["evictions"] == 1 and torch.equal(c.get("a"), entry + ord("a"))
        held = [c.acquire(k, promote=False) for k in "abc"]  # (the get promoted "a", evicting another)
        leases = [lease for lease in held if lease is not None]
        assert len(leases) == 2 and c.put("d", entry).wait(0)  # every host entry pinned
        assert "d" in c and c.stats()["tiers"]["nvme"]["puts"] >= 1 and torch.equal(c.get("d"), entry)
        for lease in leases:
            c.release(lease)
    with TieredCache(CacheConfig(host=host)) as c:
        leases = [c.acquire(k, promote=False) for k in "ab" if c.put(k, entry)]
        with pytest.raises(TierWriteError, match="host"):
            c.put("e", entry)
        assert "e" not in c and torch.equal(c.get("a"), entry)
        for lease in leases:
            c.release(lease)
