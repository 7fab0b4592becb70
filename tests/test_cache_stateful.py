"""Hypothesis stateful test: TieredCache (small host + small NVMe, both evicting) against a plain
reference model ``{(namespace, key): last value put}``.

What the model can assert, since evictions drop entries at the bottom of the hierarchy:

- a get that returns a tensor returns exactly the last value put for that key (dtype, shape, bytes);
- a deleted (and not re-put) key is never returned, nor reported by ``contains``;
- right after a get, ``contains(k) == (result is not None)``;
- a key may be missing only if, at some step since its last put, the live entries did not all fit
  the NVMe budget (with room to spare): otherwise no tier had a reason to drop it;
- budgets hold after every step; an idle cache is internally consistent (no pins, byte counts add
  up, NVMe records in memory match LMDB).
"""

from __future__ import annotations

import math
import shutil
import tempfile

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ectier import CacheConfig, HostTierConfig, NvmeTierConfig, TieredCache
from ectier.tiers.nvme_segment import BLOCK_BYTES, blocks_for

from conftest import KiB, NVME_SLACK, check_quiescent, raw_bytes

# Sizes chosen so that every interplay happens: entries larger than the host budget, host victims
# whose demotion needs NVMe room, and NVMe hits whose promotion evicts from host.
HOST_BYTES = 256 * KiB  # 16 blocks of 16 KiB
BLOCK = 16 * KiB
NVME_BYTES = 1024 * KiB  # layout v2: a payload takes whole 64 KiB blocks of the segment file

KEYS = ["a", "b", "c", "d", "e", "\x00k", "ключ"]
NAMESPACES = ["test", "other"]

# (shape, dtype): tiny, 0-dim, zero-size, 16 KiB (one block), 64 KiB, 80 KiB, 144 KiB, 208 KiB,
# 264 KiB (> host budget, fits NVMe)
SPECS = [
    ((3,), torch.int64),
    ((), torch.float16),
    ((0, 8192), torch.bfloat16),
    ((5, 7), torch.bool),
    ((8, 1024), torch.bfloat16),
    ((16, 1024), torch.float32),
    ((40, 1024), torch.bfloat16),
    ((9, 16, 1024), torch.uint8),
    ((104, 1024), torch.bfloat16),
    ((66, 1024), torch.float32),
]
if hasattr(torch, "float8_e4m3fn"):
    SPECS.append(((100,), torch.float8_e4m3fn))


def make_value(spec_index: int, seed: int) -> torch.Tensor:
    shape, dtype = SPECS[spec_index]
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = math.prod(shape) * itemsize
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="ectier-stateful-")
        self.cache: TieredCache | None = None
        self.model: dict[tuple[str, str], tuple[str, tuple[int, ...], bytes, int]] = {}
        self.deleted: set[tuple[str, str]] = set()
        # keys that may have been evicted: the live set did not fit NVMe at some point since their put
        self.at_risk: set[tuple[str, str]] = set()

    def config(self, flush_on_close: bool) -> CacheConfig:
        return CacheConfig(
            namespace="test",
            host=HostTierConfig(capacity_bytes=HOST_BYTES, block_bytes=BLOCK, pin_memory=False, admit_wait_s=1.0),
            nvme=NvmeTierConfig(path=self.dir, capacity_bytes=NVME_BYTES, sync=False, flush_on_close=flush_on_close,
                                map_initial_bytes=1 << 20),
        )

    @initialize(flush=st.booleans())
    def open(self, flush):
        self.flush_on_close = flush
        self.cache = TieredCache(self.config(flush))

    def teardown(self) -> None:
        if self.cache is not None:
            self.cache.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ helpers

    def fits_nvme(self) -> bool:
        """Everything live fits NVMe with room for the largest entry twice (the admission check is
        conservative while an overwrite or a demotion is in flight)."""
        per_record = 1024  # header allowance (keys here are short)
        # what a record holds of the budget: its header and whole blocks of the segment file
        sizes = [per_record + blocks_for(n) * BLOCK_BYTES for (_, _, _, n) in self.model.values()]
        if not sizes:
            return True
        return sum(sizes) + 2 * max(sizes) + NVME_SLACK <= NVME_BYTES

    def check_get(self, ident, got):
        if ident in self.model:
            if got is not None:
                dtype, shape, data, _ = self.model[ident]
                assert str(got.dtype).removeprefix("torch.") == dtype
                assert tuple(got.shape) == shape
                assert raw_bytes(got) == data
            elif ident not in self.at_risk:
                raise AssertionError(f"{ident!r} missing although everything always fit the NVMe budget")
        else:
            assert got is None, f"{ident!r} was never put or was deleted, yet get returned a tensor"

    # ------------------------------------------------------------------ rules

    @rule(key=st.sampled_from(KEYS), ns=st.sampled_from(NAMESPACES),
          spec=st.integers(0, len(SPECS) - 1), seed=st.integers(0, 2**31 - 1))
    def put(self, key, ns, spec, seed):
        t = make_value(spec, seed)
        if seed % 3 == 0 and t.dim() >= 2:
            t = t.transpose(0, 1)  # non-contiguous: stored in C order of the view
        self.cache.put(key, t, namespace=ns)
        self.model[(ns, key)] = (str(t.dtype).removeprefix("torch."), tuple(t.shape), raw_bytes(t), nbytes(t))
        self.deleted.discard((ns, key))
        self.at_risk.discard((ns, key))
        if not self.fits_nvme():
            self.at_risk |= set(self.model)

    @rule(key=st.sampled_from(KEYS), ns=st.sampled_from(NAMESPACES))
    def get(self, key, ns):
        got = self.cache.get(key, namespace=ns)
        self.check_get((ns, key), got)
        assert self.cache.contains(key, namespace=ns) == (got is not None)

    @rule(key=st.sampled_from(KEYS), ns=st.sampled_from(NAMESPACES))
    def contains(self, key, ns):
        present = self.cache.contains(key, namespace=ns)
        if (ns, key) not in self.model:
            assert not present
        elif not present:
            self.check_get((ns, key), None)  # allowed only when evictions could have dropped it

    @rule(key=st.sampled_from(KEYS), ns=st.sampled_from(NAMESPACES))
    def delete(self, key, ns):
        present = self.cache.contains(key, namespace=ns)
        assert self.cache.delete(key, namespace=ns) == present
        if (ns, key) in self.model:
            del self.model[(ns, key)]
            self.deleted.add((ns, key))
            self.at_risk.discard((ns, key))
        assert not self.cache.contains(key, namespace=ns)
        assert self.cache.get(key, namespace=ns) is None

    @precondition(lambda self: self.flush_on_close)
    @rule()
    def restart(self):
        self.cache.close()
        self.cache = TieredCache(self.config(True))
        check_quiescent(self.cache)

    @rule()
    def flush(self):
        self.cache.flush()

    # ------------------------------------------------------------------ invariants

    @invariant()
    def budgets_hold(self):
        if self.cache is None:
            return
        st_ = self.cache.stats()["tiers"]
        assert st_["host"]["used_bytes"] <= st_["host"]["capacity_bytes"]
        assert st_["nvme"]["used_bytes"] <= NVME_BYTES

    @invariant()
    def consistent(self):
        if self.cache is None:
            return
        check_quiescent(self.cache)
        assert len(self.cache) <= len(self.model)
        for ident in self.deleted:
            assert not self.cache.contains(ident[1], namespace=ident[0])
        for ns, key in self.model:
            if (ns, key) not in self.at_risk:
                assert self.cache.contains(key, namespace=ns), f"{(ns, key)!r} lost"


CacheMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCacheStateful = CacheMachine.TestCase
