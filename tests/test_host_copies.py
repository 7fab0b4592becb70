"""The host tier's copies in and out (issue 12, item 7): a put copies the caller's tensor straight
into a typed view of its slot (one ``copy_``), a get copies that view into its result. Every kind of
tensor a caller may hand in must still be stored as its logical C-order values, the stored bytes
must stay the cache's own (no view shared with the caller either way), and the slow path (an entry
over several block runs) must agree with the fast one.
"""

from __future__ import annotations

import pytest
import torch

from conftest import KiB, MiB, assert_same
from ectier import InvalidTensorError, TieredCache
from ectier.config import CacheConfig, HostTierConfig


def _host_cache(capacity: int = 1 * MiB, block: int = 64 * KiB) -> TieredCache:
    return TieredCache(CacheConfig(host=HostTierConfig(capacity_bytes=capacity, block_bytes=block, pin_memory=False)))


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    z = torch.randn(6, 5, dtype=torch.complex64, generator=g)
    base = torch.randn(12, 16, generator=g).bfloat16()
    return {
        "conjugate view": z.conj(),  # lazy conj bit: stored values are the conjugates
        "negative view": z.conj().imag,  # lazy neg bit, strided
        "requires grad": torch.randn(4, 8, generator=g, requires_grad=True),
        "non-leaf with grad": torch.randn(4, 8, generator=g, requires_grad=True) * 2,
        "transposed": base.t(),
        "stepped": base[::3, 1::4],
        "expanded": torch.arange(4, dtype=torch.int32).expand(3, 4),
        "zero-dim": torch.tensor(3.5, dtype=torch.float64),
        "one element, odd stride": torch.arange(10, dtype=torch.float32)[::5][:1],
        "zero size": torch.empty(0, 8192, dtype=torch.bfloat16),
        "bool": torch.tensor([[True, False, True]]),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_put_stores_the_logical_values_of_any_tensor(name):
    x = _cases()[name]
    expected = x.detach().resolve_conj().resolve_neg().contiguous().clone()
    with _host_cache() as cache:
        cache.put("k", x)
        got = cache.get("k")
        assert_same(got, expected)
        assert not got.requires_grad
        out = torch.empty_like(expected)
        assert cache.get("k", out=out) is out
        assert_same(out, expected)


@pytest.mark.parametrize("where", ["host, one run", "host, several runs", "nvme"])
@pytest.mark.parametrize("view", ["conj", "neg"])
def test_a_conjugate_or_negative_out_is_refused_wherever_the_entry_lies(make_cache, where, view):
    """Bytes written into a conjugate (or negative) view are not the values it shows: such an
    ``out`` is refused (InvalidTensorError naming it) before any read, wherever the entry lies;
    it used to come back unfilled, or with torch's RuntimeError."""
    z = torch.randn(3 * 64 * KiB // 8 + 5, dtype=torch.complex64)  # 4 blocks
    cache, _ = make_cache(host_bytes=8 * 64 * KiB if where.startswith("host") else 0, nvme_bytes=4 * MiB)
    if where == "host, several runs":  # free runs of one block: the slot is 4 runs
        for i in range(8):
            cache.put(f"f{i}", torch.full((16 * KiB,), float(i)))
        for i in (1, 3, 5, 7):
            cache.delete(f"f{i}")
    cache.put("z", z)
    out = torch.zeros_like(z).conj() if view == "conj" else torch.zeros_like(z).conj().imag.conj()
    assert out.is_conj() or out.is_neg()
    with pytest.raises(InvalidTensorError, match="conjugate or negative view"):
        cache.get("z", out=out)
    assert_same(cache.get("z"), z)  # nothing changed


def test_a_put_with_grad_leaves_no_autograd_history_in_the_cache():
    x = torch.randn(64, 64, requires_grad=True)
    with _host_cache() as cache:
        cache.put("k", x * 3)
        got = cache.get("k")
        assert got.grad_fn is None and not got.requires_grad
        assert not cache.host_arena.requires_grad


def test_stored_bytes_are_the_caches_own():
    """Writing into the source after put, or into a result after get, changes nothing stored."""
    x = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    keep = x.clone()
    with _host_cache() as cache:
        cache.put("k", x)
        x.zero_()
        first = cache.get("k")
        first.fill_(-1)
        assert_same(cache.get("k"), keep)
        out = torch.empty(64, 64)
        cache.get("k", out=out)
        out.fill_(-2)
        assert_same(cache.get("k"), keep)


def test_get_out_of_another_shape_with_the_same_elements_is_refused_untouched():
    """get's docstring: another shape raises (it used to be filled and viewed in the entry's shape)."""
    x = torch.arange(24, dtype=torch.int16).reshape(2, 12)
    with _host_cache() as cache:
        cache.put("k", x)
        out = torch.zeros(24, dtype=torch.int16)
        with pytest.raises(InvalidTensorError, match=r"out: .*\(2, 12\).*\(24,\)"):
            cache.get("k", out=out)
        assert not out.any()


def test_an_entry_over_several_block_runs_round_trips():
    """Fill the arena, free every other entry, then put one entry that needs several free runs."""
    block = 16 * KiB
    with _host_cache(capacity=8 * block, block=block) as cache:
        for i in range(8):
            cache.put(f"f{i}", torch.full((block // 4,), float(i)))
        for i in range(0, 8, 2):
            cache.delete(f"f{i}")
        big = torch.randn(4 * block // 2).bfloat16().reshape(-1, 64)  # 4 blocks: only split runs are free
        cache.put("big", big)
        assert_same(cache.get("big"), big)
        out = torch.empty_like(big)
        cache.get("big", out=out)
        assert_same(out, big)
        for i in range(1, 8, 2):
            assert_same(cache.get(f"f{i}"), torch.full((block // 4,), float(i)))
