"""Write the golden NVMe records in this folder: ``python tests/golden/make_golden.py``.

Each ``<name>.bin`` is one whole record as the NVMe tier stores it, ``pack_header(header) + payload``
(see :mod:`ectier.codec`), of a small deterministic bf16-like tensor. The files are checked in and
``tests/test_record.py`` decodes them with today's code: they prove that new code reads old bytes.

Never regenerate an existing file to make a test pass: a golden file that no longer decodes means
the format changed, which needs a new ``RECORD_FORMAT_VERSION`` (old files stay, new ones are added
next to them). This script therefore only writes files that are missing, unless ``--force``.

The tensor bytes come from integer arithmetic only (splitmix64), not from numpy's random
distributions or libm, so the test can regenerate them bit for bit on any machine and numpy version.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent

NAMESPACE = "qwen3_vl_moe/vision/bfloat16"
CREATED_NS = 1_795_000_000_000_000_000  # a fixed instant, so the files are reproducible
# A key that pins the UTF-8 encoding: NUL, Cyrillic, an emoji (4 bytes of UTF-8).
KEY = "golden\x00mm_hash/ключ/\U0001f389"

# file stem -> how the record was written. Append; never edit or remove an entry.
RECORDS = {
    "v1_raw": {"codec": "raw", "params": {}, "shape": (4, 512), "version": 1},
    "v1_zstd": {"codec": "zstd", "params": {"level": 1, "threads": 0}, "shape": (4, 512), "version": 2},
    "v1_zstd-planes": {
        "codec": "zstd-planes",
        "params": {"level": 1, "threads": 0},
        "shape": (4, 512),
        "version": 3,
    },
    "v1_zstd-planes_empty": {
        "codec": "zstd-planes",
        "params": {"level": 1, "threads": 0},
        "shape": (0, 8192),
        "version": 4,
    },
}
DTYPE = "bfloat16"
ITEMSIZE = 2


def _splitmix64(index: np.ndarray) -> np.ndarray:
    """splitmix64 of ``index`` (uint64 array), wrapping arithmetic."""
    z = index * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def golden_raw_bytes(numel: int) -> bytes:
    """``numel`` little-endian bf16 values shaped like encoder output: random sign and 7-bit
    mantissa, exponent concentrated in 2**-5 .. 2**1 (the high byte compresses, the low does not)."""
    h = _splitmix64(np.arange(1, numel + 1, dtype=np.uint64))
    sign = (h >> np.uint64(63)) & np.uint64(1)
    exponent = np.uint64(122) + ((h >> np.uint64(40)) & np.uint64(0xFF)) % np.uint64(7)
    mantissa = h & np.uint64(0x7F)
    bf16 = (sign << np.uint64(15)) | (exponent << np.uint64(7)) | mantissa
    return bf16.astype("<u2").tobytes()


def build_record(stem: str) -> bytes:
    """The record bytes for ``RECORDS[stem]``, written with today's code."""
    from ectier.codec import RecordHeader, checksum, get_codec, pack_record

    spec = RECORDS[stem]
    numel = int(np.prod(spec["shape"]))
    raw = golden_raw_bytes(numel)
    codec = get_codec(spec["codec"], **spec["params"])
    payload = bytes(codec.encode(raw, ITEMSIZE))
    header = RecordHeader(
        codec_id=codec.codec_id,
        dtype=DTYPE,
        shape=tuple(spec["shape"]),
        namespace=NAMESPACE,
        key=KEY,
        raw_nbytes=len(raw),
        payload_nbytes=len(payload),
        payload_checksum=checksum(payload),
        version=spec["version"],
        created_ns=CREATED_NS,
        codec_config=codec.get_params(),
    )
    return bytes(pack_record(header, payload))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="overwrite existing golden files")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE.parent.parent))  # the repository root, for `import ectier`
    for stem in RECORDS:
        path = HERE / f"{stem}.bin"
        if path.exists() and not args.force:
            print(f"keep   {path.name} (exists; --force to overwrite)")
            continue
        data = build_record(stem)
        path.write_bytes(data)
        print(f"wrote  {path.name} ({len(data)} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
