"""Codecs of the NVMe tier: encode / decode MB/s and compression ratio on a realistic bf16 payload.

Payload: ``torch.randn(N, 8192).bfloat16()`` bytes (synthetic N(0, 1); real Qwen3-VL encoder outputs
compress to ~1.28 plain and ~1.5 split at zstd level 1, docs/benchmarks.md). One thread, as the NVMe
tier runs them. ``decode`` writes into a preallocated buffer (``decode_into``). ``raw`` encode is a
zero-copy view (its MB/s only measures call overhead); ``raw`` decode is one memory copy.
``xxh3 checksum`` is the record checksum computed on every NVMe write and verified on every read.

MB/s = raw (uncompressed) bytes / median time, for encode and decode alike.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ectier.codec import get_codec
from ectier.record import checksum

CODECS = [("raw", {}), ("zstd", {"level": 1}), ("zstd-planes", {"level": 1})]


def _raw(payloads, tokens) -> np.ndarray:
    return payloads(tokens).reshape(-1).view(torch.uint8).numpy()


@pytest.mark.parametrize("name,params", CODECS, ids=[c[0] for c in CODECS])
def test_codec_encode(measure, payloads, tokens, name, params):
    codec = get_codec(name, **params)
    data = _raw(payloads, tokens)
    payload = codec.encode(data, 2)
    ratio = data.nbytes / memoryview(payload).nbytes
    measure(lambda: codec.encode(data, 2), suite="codec", tokens=tokens, op="encode", impl=f"{name} encode",
            role="codec", bytes_per_call=data.nbytes, codec=f"{name}{'-L%d' % params['level'] if params else ''}",
            compression_ratio=ratio)


@pytest.mark.parametrize("name,params", CODECS, ids=[c[0] for c in CODECS])
def test_codec_decode(measure, payloads, tokens, name, params):
    codec = get_codec(name, **params)
    data = _raw(payloads, tokens)
    payload = codec.encode(data, 2)
    if name == "raw":
        payload = bytes(payload)  # a stored payload, not a view of the source
    ratio = data.nbytes / len(memoryview(payload))
    out = np.empty_like(data)
    codec.decode_into(payload, out, 2)
    assert np.array_equal(out, data)
    measure(lambda: codec.decode_into(payload, out, 2), suite="codec", tokens=tokens, op="decode",
            impl=f"{name} decode", role="codec", bytes_per_call=data.nbytes,
            codec=f"{name}{'-L%d' % params['level'] if params else ''}", compression_ratio=ratio)


def test_codec_checksum(measure, payloads, tokens):
    data = _raw(payloads, tokens)
    measure(lambda: checksum(data), suite="codec", tokens=tokens, op="checksum", impl="xxh3 checksum",
            role="codec", bytes_per_call=data.nbytes, codec="xxh3_64", compression_ratio=None)
