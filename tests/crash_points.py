"""Child process of ``test_crash_campaign.py``: stop at one chosen point of a write and wait to be SIGKILLed.

``python tests/crash_points.py POINT STORE_DIR``

1. opens a TieredCache on ``STORE_DIR`` (variant by point), puts ``k`` = v1 (committed; prints
   ``COMMITTED``) and ``other`` = v3;
2. arms a hook at ``POINT`` and starts the operation under test (put ``k`` = v2, or delete ``k``);
3. at the hook prints ``AT <POINT>`` and sleeps until killed.

Points (the LMDB write transaction is reached through a proxy of the tier's environment, since an
``lmdb.Environment`` cannot be monkeypatched):

- ``mid-txn-payload``: v2's payload written to the segment file (and synced), inside the index
  transaction of v2 after its ``put``, before the commit (layout v2: the payload's blocks are
  orphaned by the kill and free again at the next open);
- ``after-commit``: after the v2 transaction committed, before the tier's in-memory bookkeeping;
- ``mid-delete-txn``: inside the delete transaction of ``k``, after the header was deleted;
- ``wt-between-commit-and-write``: write-through overwrite, after v2 committed in the host tier and
  before v2 is written to NVMe (the v1 record must still be there);
- ``wt-mid-txn``: write-through overwrite, inside the v2 NVMe transaction;
- ``wt-returned``: write-through + sync, right after ``put`` of v2 returned (kill before anything else);
- ``wt-failed-returned``: write-through overwrite whose NVMe write fails (``TierWriteError``), right
  after ``put`` of v2 returned: the v1 record must be gone (v2 lives in host memory only).
- ``move-mid-txn``, ``move-after-commit``: entries of 7/8 of the budget, so v2's write grows the
  segment file past it and v2 is then moved down (``ectier/tiers/nvme_compact.py``): inside the
  move's index transaction after its ``put``, and after its commit before the old blocks are freed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
from ectier import testing, testing_internals

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ectier import CacheConfig, HostTierConfig, NvmeTierConfig, TieredCache  # noqa: E402
from ectier.errors import TierWriteError  # noqa: E402
from ectier.tiers.nvme import NvmeTier  # noqa: E402

KiB = 1 << 10
POINTS = ("mid-txn-payload", "after-commit", "mid-delete-txn", "wt-between-commit-and-write", "wt-mid-txn",
          "wt-returned", "wt-failed-returned", "move-mid-txn", "move-after-commit")
MOVE_ENTRY = (3 << 20) + 512 * KiB  # the move points' v1 and v2: 7/8 of MOVE_CAPACITY
MOVE_CAPACITY = 4 << 20


def value(n: int, seed: int, dtype=torch.float16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(dtype)


def V1(point: str = "") -> torch.Tensor:  # noqa: N802
    return value(MOVE_ENTRY if point.startswith("move-") else 48 * KiB, 1)


def V2(point: str = "") -> torch.Tensor:  # noqa: N802 - another size and dtype
    return value(MOVE_ENTRY if point.startswith("move-") else 80 * KiB, 2, torch.float32)


def V3(point: str = "") -> torch.Tensor:  # noqa: N802
    return value(16 * KiB, 3)


def config(point: str, store: str) -> CacheConfig:
    wt = point.startswith("wt-")
    return CacheConfig(
        namespace="test",
        host=HostTierConfig(capacity_bytes=1 << 20 if wt else 0, block_bytes=16 * KiB, pin_memory=False),
        nvme=NvmeTierConfig(path=store, capacity_bytes=MOVE_CAPACITY if point.startswith("move-") else 8 << 20,
                            sync=True, write_through=wt, flush_on_close=False,
                            map_initial_bytes=4 << 20),
    )


def stop(point: str) -> None:
    print(f"AT {point}", flush=True)
    while True:
        time.sleep(60)


class _Txn:
    def __init__(self, txn, env) -> None:
        self._txn, self._env = txn, env

    def __enter__(self):
        self._txn.__enter__()
        return self

    def __exit__(self, *exc):
        return self._txn.__exit__(*exc)

    def put(self, key, value, db=None, **kw):
        r = self._txn.put(key, value, db=db, **kw)
        if self._env.armed in ("mid-txn-payload", "wt-mid-txn", "move-mid-txn") and db is self._env.meta_db:
            stop(self._env.armed)
        return r

    def delete(self, key, value=b"", db=None):
        r = self._txn.delete(key, value, db=db)
        if self._env.armed == "mid-delete-txn" and db is self._env.meta_db:
            stop(self._env.armed)
        return r

    def __getattr__(self, name):
        return getattr(self._txn, name)


class _Env:
    def __init__(self, env, tier: NvmeTier) -> None:
        self._env = env
        self.meta_db = testing.lmdb_of(tier).meta
        self.armed: str | None = None

    def begin(self, *args, **kwargs):
        txn = self._env.begin(*args, **kwargs)
        return _Txn(txn, self) if kwargs.get("write") and self.armed else txn

    def __getattr__(self, name):
        return getattr(self._env, name)


def main(point: str, store: str) -> None:
    cache = TieredCache(config(point, store))
    cache.put("k", V1(point))
    cache.put("other", V3(point))
    print("COMMITTED", flush=True)
    tier = testing.tier(cache, "nvme")
    env = _Env(testing.lmdb_of(tier).env, tier)
    testing.set_lmdb_env(tier, env)
    hooks = contextlib.ExitStack()  # never closed: the process is killed at its hook
    if point == "after-commit":
        hooks.enter_context(testing_internals.before_nvme_record(
            tier, lambda d, rec: stop(point) if rec is not None else None))  # v2 committed, not yet recorded
    elif point == "wt-between-commit-and-write":
        NvmeTier.write = lambda self, d, rec: stop(point)
    elif point == "wt-failed-returned":
        def fail(self, d, rec):
            raise TierWriteError("nvme tier: injected write failure")
        NvmeTier.write = fail
    elif point == "move-mid-txn":  # inside the move's transaction, after its put
        hooks.enter_context(testing_internals.around_nvme_move(tier, before=lambda d: setattr(env, "armed", point)))
    elif point == "move-after-commit":
        hooks.enter_context(testing_internals.around_nvme_move(tier, after=lambda d, committed: stop(point)))
    elif point not in ("wt-returned", "wt-failed-returned"):
        env.armed = point
    if point == "mid-delete-txn":
        cache.delete("k")
    else:
        cache.put("k", V2(point))
    if point in ("wt-returned", "wt-failed-returned"):
        stop(point)
    raise SystemExit(f"{point}: the hook was never reached")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
