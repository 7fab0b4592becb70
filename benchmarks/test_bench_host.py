"""Host tier: ``cache.put`` + ``cache.get`` vs plain memory copies of the same bytes, same run.

One call of the ectier side is ``put(key, x)`` then ``get(key)`` on a host-only
:class:`~ectier.TieredCache` big enough that nothing is evicted (the same key is overwritten each
call, as a steady stream of puts would). ``put`` is one copy into the arena, ``get`` one copy out,
so the reference is two copies of the same bytes into preallocated buffers (``ectier put+get(out=)``
is the same with ``get(key, out=buffer)``, which reuses the caller's buffer, where the API has it):

- ``torch copy_ x2``   ``a.copy_(x); b.copy_(a)`` (torch's copy runs on all intra-op threads) — the goal
- ``numpy copyto x2``  the same with ``np.copyto`` (one thread)

GB/s = bytes moved per call / median time: ``2 x entry`` for put+get, ``1 x entry`` for put or get.
Put and get are also measured alone against one ``copy_``. Two diagnostic references show where a
gap comes from: ``torch empty+copy_`` (allocate the destination, then copy: what any API that
returns a new tensor must do) and ``torch copy_ x2, 2 rotating dst`` (the put copy alternates
between two buffers, as the arena's slots do when a key is overwritten, so its destination is not
the one the previous call left in the last-level cache).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from ectier import TieredCache
from ectier.config import CacheConfig, HostTierConfig

MiB = 1 << 20

REF_COPY2 = "torch copy_ x2"
REF_NUMPY2 = "numpy copyto x2"
REF_COPY1 = "torch copy_ x1"
REF_ALLOC1 = "torch empty+copy_ (alloc)"
REF_ROTATE2 = "torch copy_ x2, 2 rotating dst"

#: ``TieredCache.get(..., out=tensor)`` copies into the caller's tensor instead of a new one.
HAS_GET_OUT = "out" in inspect.signature(TieredCache.get).parameters
needs_out = pytest.mark.skipif(not HAS_GET_OUT, reason="TieredCache.get has no out= parameter")


@pytest.fixture
def host_cache(tokens):
    """A host-only cache with room for three entries of this size (no eviction during a run)."""
    nbytes = tokens * 8192 * 2
    cfg = CacheConfig(host=HostTierConfig(capacity_bytes=3 * nbytes + 4 * MiB))
    cache = TieredCache(cfg)
    yield cache
    cache.close()


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


# ------------------------------------------------------------------------------ put + get


def test_host_put_get_ectier(measure, payloads, tokens, host_cache):
    x = payloads(tokens)
    host_cache.put("img", x)
    assert torch.equal(_flat(host_cache.get("img")), _flat(x))

    def put_get():
        host_cache.put("img", x)
        return host_cache.get("img")

    put_get()
    measure(put_get, suite="host", tokens=tokens, op="put+get", impl="ectier put+get", role="ectier",
            bytes_per_call=2 * x.nbytes, compare=(REF_COPY2, REF_NUMPY2, REF_ROTATE2), goal=True)
    assert host_cache.stats()["tiers"]["host"]["evictions"] == 0


@needs_out
def test_host_put_get_out_ectier(measure, payloads, tokens, host_cache):
    """The same with ``get(key, out=buffer)``: the caller's buffer is reused, no fresh allocation."""
    x = payloads(tokens)
    o = torch.empty_like(x)
    host_cache.put("img", x)
    assert host_cache.get("img", out=o) is not None and torch.equal(_flat(o), _flat(x))

    def put_get_out():
        host_cache.put("img", x)
        return host_cache.get("img", out=o)

    put_get_out()
    measure(put_get_out, suite="host", tokens=tokens, op="put+get", impl="ectier put+get(out=)", role="ectier",
            bytes_per_call=2 * x.nbytes, compare=(REF_COPY2, REF_NUMPY2, REF_ROTATE2), goal=True)


def test_host_put_get_ref_torch(measure, payloads, tokens):
    x = payloads(tokens)
    a, b = torch.empty_like(x), torch.empty_like(x)

    def copy2():
        a.copy_(x)
        b.copy_(a)

    copy2()
    measure(copy2, suite="host", tokens=tokens, op="put+get", impl=REF_COPY2, role="reference",
            bytes_per_call=2 * x.nbytes)


def test_host_put_get_ref_rotating(measure, payloads, tokens):
    """Diagnostic: the put copy goes to one of two buffers in turn, as ectier's arena slots do when a
    key is overwritten (the destination is then not the buffer the previous call left in cache)."""
    x = payloads(tokens)
    slots = [torch.empty_like(x), torch.empty_like(x)]
    b = torch.empty_like(x)
    turn = [0]

    def copy2():
        turn[0] ^= 1
        slots[turn[0]].copy_(x)
        b.copy_(slots[turn[0]])

    copy2()
    copy2()
    measure(copy2, suite="host", tokens=tokens, op="put+get", impl=REF_ROTATE2, role="diagnostic",
            bytes_per_call=2 * x.nbytes)


def test_host_put_get_ref_numpy(measure, payloads, tokens):
    xs = _flat(payloads(tokens)).numpy()
    a, b = np.empty_like(xs), np.empty_like(xs)

    def copy2():
        np.copyto(a, xs)
        np.copyto(b, a)

    copy2()
    measure(copy2, suite="host", tokens=tokens, op="put+get", impl=REF_NUMPY2, role="reference",
            bytes_per_call=2 * xs.nbytes)


# ------------------------------------------------------------------------------ put, get alone


def test_host_put_ectier(measure, payloads, tokens, host_cache):
    x = payloads(tokens)
    host_cache.put("img", x)
    measure(lambda: host_cache.put("img", x), suite="host", tokens=tokens, op="put", impl="ectier put",
            role="ectier", bytes_per_call=x.nbytes, compare=(REF_COPY1,))


def test_host_get_ectier(measure, payloads, tokens, host_cache):
    x = payloads(tokens)
    host_cache.put("img", x)
    host_cache.get("img")
    measure(lambda: host_cache.get("img"), suite="host", tokens=tokens, op="get", impl="ectier get",
            role="ectier", bytes_per_call=x.nbytes, compare=(REF_COPY1, REF_ALLOC1))


@needs_out
def test_host_get_out_ectier(measure, payloads, tokens, host_cache):
    x = payloads(tokens)
    o = torch.empty_like(x)
    host_cache.put("img", x)
    host_cache.get("img", out=o)
    measure(lambda: host_cache.get("img", out=o), suite="host", tokens=tokens, op="get", impl="ectier get(out=)",
            role="ectier", bytes_per_call=x.nbytes, compare=(REF_COPY1,))


def test_host_copy_ref_torch(measure, payloads, tokens):
    x = payloads(tokens)
    a = torch.empty_like(x)
    a.copy_(x)
    measure(lambda: a.copy_(x), suite="host", tokens=tokens, op="copy", impl=REF_COPY1, role="reference",
            bytes_per_call=x.nbytes)


def test_host_alloc_copy_diag_torch(measure, payloads, tokens):
    x = payloads(tokens)

    def alloc_copy():
        return torch.empty(x.shape, dtype=x.dtype).copy_(x)

    alloc_copy()
    measure(alloc_copy, suite="host", tokens=tokens, op="copy", impl=REF_ALLOC1, role="diagnostic",
            bytes_per_call=x.nbytes)


# ------------------------------------------------------------------------------ interleaved


def test_host_put_get_paired(paired, payloads, tokens, host_cache):
    """ectier put+get and both references interleaved round by round (ratio robust to load drift)."""
    x = payloads(tokens)
    xs = _flat(x).numpy()
    a, b = torch.empty_like(x), torch.empty_like(x)
    an, bn = np.empty_like(xs), np.empty_like(xs)

    def ectier():
        host_cache.put("img", x)
        host_cache.get("img")

    def ref_torch():
        a.copy_(x)
        b.copy_(a)

    def ref_numpy():
        np.copyto(an, xs)
        np.copyto(bn, an)

    for f in (ectier, ref_torch, ref_numpy):
        f()
    paired({"ectier put+get": ectier, REF_COPY2: ref_torch, REF_NUMPY2: ref_numpy},
           suite="host", tokens=tokens, op="put+get", bytes_per_call=2 * x.nbytes)


@needs_out
def test_host_put_get_out_paired(paired, payloads, tokens, host_cache):
    """ectier put+get(out=) and the torch reference interleaved round by round."""
    x = payloads(tokens)
    o, a, b = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)

    def ectier():
        host_cache.put("img", x)
        host_cache.get("img", out=o)

    def ref_torch():
        a.copy_(x)
        b.copy_(a)

    for f in (ectier, ref_torch):
        f()
    paired({"ectier put+get(out=)": ectier, REF_COPY2: ref_torch},
           suite="host", tokens=tokens, op="put+get", bytes_per_call=2 * x.nbytes)
