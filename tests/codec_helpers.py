"""Helpers of the codec and record tests (test_codec.py, test_record.py): the codecs under
test, byte builders (``make_bytes``, ``bf16_like``: numpy, no torch) and a typical record header.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings

from ectier.codec import PlaneZstdCodec, RawCodec, ZstdCodec
from ectier.record import RecordHeader

POISON = 0xAB
ITEMSIZES = (1, 2, 4, 8)
ALL_CODECS = (RawCodec(), ZstdCodec(), PlaneZstdCodec())
ZSTD_CODECS = (ZstdCodec(), PlaneZstdCodec())


def slow(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def bf16_like(numel: int, seed: int = 0) -> np.ndarray:
    """Realistic bf16 bytes without torch: float32 N(0, 1) truncated to the top 16 bits."""
    f32 = np.random.default_rng(seed).standard_normal(numel, dtype=np.float32)
    return (f32.view(np.uint32) >> 16).astype("<u2").view(np.uint8)


def make_bytes(kind: str, nbytes: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.integers(0, 256, nbytes, dtype=np.uint8)
    if kind == "zeros":
        return np.zeros(nbytes, dtype=np.uint8)
    if kind == "repeat":
        return np.resize(rng.integers(0, 256, 7, dtype=np.uint8), nbytes)
    if kind == "bf16":
        out = bf16_like((nbytes + 1) // 2, seed)
        return np.ascontiguousarray(out[:nbytes])
    raise AssertionError(kind)


def make_header(**overrides) -> RecordHeader:
    fields = dict(
        codec_id=1,
        dtype="bfloat16",
        shape=(64, 8192),
        namespace="qwen3_vl_moe/bf16",
        key="mm_hash:3f2a",
        raw_nbytes=64 * 8192 * 2,
        payload_nbytes=700_000,
        payload_checksum=0x0123456789ABCDEF,
        version=42,
        created_ns=1_795_000_000_123_456_789,
        codec_config={"level": 1, "threads": 0},
    )
    fields.update(overrides)
    return RecordHeader(**fields)
