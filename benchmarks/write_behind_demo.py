"""``ectier demo`` with and without the host tier's write-behind, interleaved (docs/benchmarks.md,
"Write-behind of dirty host entries").

Each variant runs the default demo (``run_demo(DemoOptions(), quiet=True)``) in a fresh process;
the variants alternate order per round so that each sees the machine's load alike. A variant is
``base`` (the tree at ``--base``, e.g. an export of main) or ``wb:<fraction>`` (this tree with
``host.write_behind_fraction`` set on the demo's config). Every run also records the seconds spent
in evictions made inside promotions (NVMe hits), by wrapping ``Mover.admit`` / ``Mover.evict``
(the same code on both sides). One JSON per run in ``OUT``; a summary line per run on stdout.

    python benchmarks/write_behind_demo.py --rounds 2 --out /tmp/wb --base /tmp/main-tree base wb:0.5 wb:1.0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

DRIVER = r'''
import dataclasses, sys, threading, time
import ectier.demo as D
from ectier.mover import Mover
frac = sys.argv[2]
if frac != "base":
    orig = D._cache_config
    def cfg(*a):
        c = orig(*a)
        return dataclasses.replace(c, host=dataclasses.replace(c.host, write_behind_fraction=float(frac)))
    D._cache_config = cfg
tl = threading.local()
acc = {"promo_evict_s": 0.0, "promo_evictions": 0}
_admit, _evict = Mover.admit, Mover.evict
def admit(self, tier, digest, meta, version, *, promotion, protect=None):
    tl.promo = promotion
    try:
        return _admit(self, tier, digest, meta, version, promotion=promotion, protect=protect)
    finally:
        tl.promo = False
def evict(self, tier, victims, *, protect=None):
    t0 = time.perf_counter()
    try:
        return _evict(self, tier, victims, protect=protect)
    finally:
        if getattr(tl, "promo", False):
            acc["promo_evict_s"] += time.perf_counter() - t0
            acc["promo_evictions"] += len(victims)
Mover.admit, Mover.evict = admit, evict
s = D.run_demo(D.DemoOptions(), quiet=True)
s["promo"] = acc
D.write_json(s, sys.argv[1])
'''


def summary(path: Path) -> str:
    s = json.loads(path.read_text())
    e, b, p = s["ectier"], s["baseline"], s["promo"]
    h = e["stats"]["tiers"]["host"]
    line = (f"{path.stem:<14} load x{s['speedup']['load']:.2f}  host {e['get_host_gbps'] or 0:.2f}  "
            f"nvme {e['get_nvme_gbps'] or 0:.2f}  baseline {b['load_gbps']:.2f} GB/s  nvme-hit s {e['get_nvme_s']:.2f} "
            f"(in eviction writes {p['promo_evict_s']:.2f})")
    if "dirty_evictions" in h:
        line += f"  dirty/clean evictions {h['dirty_evictions']}/{h['clean_evictions']}"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--base", help="root of the tree the 'base' variant imports ectier from")
    ap.add_argument("variants", nargs="+")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    here = str(Path(__file__).resolve().parents[1])
    for r in range(args.rounds):
        for v in args.variants if r % 2 == 0 else args.variants[::-1]:
            root = args.base if v == "base" else here
            if root is None:
                raise SystemExit("--base: needed for the 'base' variant")
            frac = "base" if v == "base" else v.split(":", 1)[1]
            path = out / f"{v.replace(':', '_')}_r{r}.json"
            subprocess.run([sys.executable, "-c", DRIVER, str(path), frac], check=True,
                           env={**os.environ, "PYTHONPATH": root})
            print(summary(path), flush=True)


if __name__ == "__main__":
    main()
