"""Write the golden NVMe *store* of layout v1 (``store_v1/``): ``python tests/golden/make_golden_store.py``.

Layout v1 (ectier before issue 12) kept header and payload in one LMDB environment
(``lmdb/data.mdb``: databases ``meta``, ``data``, ``quarantine``, ``settings``; ``settings/format``
= ``1``). ``tests/test_nvme_layout.py`` opens a copy of this store with today's code and checks that
it is migrated to layout v2 with every record intact (and what ``ectier fsck`` says of it).

The store was written once, with the v1 code (commit 1b08e84), and is checked in; this script
documents how. It needs that old code: it refuses to run against a layout-v2 ectier. The records are
those of ``make_golden.py`` (same namespace, keys ``golden-<stem>``, same tensor bytes).
"""

from __future__ import annotations

import pathlib
import shutil
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
sys.path.insert(0, str(HERE))

SPECS = {"raw": (4, 512), "zstd-planes": (16, 512)}  # codec -> shape of its store
KEYS = [f"golden-{i}" for i in range(3)]


def main() -> int:
    import make_golden
    import numpy as np
    import torch

    from ectier.config import NvmeTierConfig
    from ectier.entry import EntryMeta, entry_digest
    from ectier.tiers import nvme as nvme_mod

    if getattr(nvme_mod, "STORE_FORMAT", None) != 1:
        print("needs the layout-v1 ectier (STORE_FORMAT 1)", file=sys.stderr)
        return 1
    for codec, shape in SPECS.items():
        target = HERE / f"store_v1_{codec}"
        shutil.rmtree(target, ignore_errors=True)
        tier = nvme_mod.NvmeTier(NvmeTierConfig(path=str(target), capacity_bytes=1 << 30, codec=codec,
                                                map_initial_bytes=1 << 20))
        numel = int(np.prod(shape))
        for i, key in enumerate(KEYS):
            raw = make_golden.golden_raw_bytes(numel * (i + 1))
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            meta = EntryMeta(make_golden.NAMESPACE, key, "bfloat16", (shape[0] * (i + 1), shape[1]), len(raw))
            tier.write(entry_digest(meta.namespace, key), tier.encode(meta, t, 100 + i))
        tier.close()
        (target / "ectier.lock").unlink()
        (target / "lmdb" / "lock.mdb").unlink()
        print("wrote", target, sorted(p.name for p in (target / "lmdb").iterdir()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
