"""The building blocks of ``ectier demo``: the working set of photographs (offline too), content
hashes, the stand-in encoder (shapes, determinism, bytes independent of the CPU kernels, exact
arithmetic), the Zipf request stream, the safetensors baseline and the bitwise comparison."""

from __future__ import annotations

import os
import types

import numpy as np
import pytest
import torch

import ectier.demo as demo
import ectier.demo_workload as demo_workload
from ectier.demo_replay import same_bytes
from ectier.errors import ConfigError
from ectier.sizing import image_tokens


# ============================================================================== building blocks


def test_load_images_skips_photographs_that_need_a_download(monkeypatch):
    real = demo_workload.skimage_data()

    def offline(exc):
        def loader():
            raise exc
        return loader

    fake = types.SimpleNamespace(**{name: getattr(real, name) for name in demo.SKIMAGE_PHOTOS})
    fake.camera = offline(ModuleNotFoundError("requires pooch"))
    fake.coffee = offline(ConnectionError("network is unreachable"))
    monkeypatch.setattr(demo_workload, "skimage_data", lambda: fake)
    notes = []
    images, origin = demo.load_images(warn=notes.append)
    names = [im.name for im in images]
    assert origin == "scikit-image"
    assert "camera" not in names and "coffee" not in names and "astronaut" in names
    assert sum("skipped" in n for n in notes) == 2
    # the seed sizes are still there, made from real photographs
    sizes = {(im.width, im.height) for im in images if im.source == "skimage-resized"}
    assert sizes == {(256, 256), (1024, 1024), (1920, 1080)}


def test_working_set_has_the_seed_sizes_and_distinct_keys():
    images, origin = demo.load_images()
    assert origin == "scikit-image"
    assert len({im.mm_hash for im in images}) == len(images) >= 15
    seed_sizes = {(im.width, im.height) for im in images if im.source == "skimage-resized"}
    assert seed_sizes == {(256, 256), (1024, 1024), (1920, 1080)}
    assert {im.name for im in images} >= {"astronaut", "coffee", "retina", "hubble_deep_field"}
    for im in images:
        assert im.pixels.dtype == np.uint8


def test_an_images_limit_above_the_working_set_says_so():
    notes: list[str] = []
    images, _ = demo.load_images()
    more, _ = demo.load_images(len(images) + 79, warn=notes.append)
    assert [im.mm_hash for im in more] == [im.mm_hash for im in images]
    assert any(f"images: {len(images) + 79} asked for" in n and f"has {len(images)}" in n for n in notes), notes
    notes.clear()
    demo.load_images(len(images), warn=notes.append)
    assert not any("asked for" in n for n in notes)


def test_mm_hash_is_a_content_hash():
    a = np.arange(12, dtype=np.uint8).reshape(3, 4)
    assert demo.mm_hash(a) == demo.mm_hash(a.copy())
    assert len(demo.mm_hash(a)) == 64
    b = a.copy()
    b[0, 0] += 1
    assert demo.mm_hash(a) != demo.mm_hash(b)
    assert demo.mm_hash(a) != demo.mm_hash(a.reshape(4, 3))  # same bytes, other shape


def test_stand_in_encoder_shapes_and_determinism():
    enc = demo.StandInEncoder()
    rng = np.random.default_rng(0)
    for w, h, n in ((256, 256, 64), (1024, 1024, 1024), (1920, 1080, 2040), (300, 200, None)):
        px = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        out = enc.encode(px)
        assert out.dtype == torch.bfloat16 and out.is_contiguous()
        assert tuple(out.shape) == image_tokens(w, h).shape
        if n is not None:
            assert out.shape[0] == n
        again = demo.StandInEncoder().encode(px)  # another instance, same seed: same bytes
        assert torch.equal(out.view(torch.int16), again.view(torch.int16))
    grey = rng.integers(0, 256, (300, 400), dtype=np.uint8)
    out = enc.encode(grey)
    # one pixel changes the output
    grey2 = grey.copy()
    grey2[123, 321] ^= 0x80
    assert not torch.equal(out, enc.encode(grey2))
    g = demo.StandInEncoder("gemma3").encode(grey)
    assert tuple(g.shape) == (256, 5376) and g.dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="pixels"):
        enc.encode(grey.astype(np.float32))


_ENCODE_DIGESTS = """
import hashlib, sys
import numpy as np
import ectier.demo as demo
rng = np.random.default_rng(5)
h = hashlib.blake2b(digest_size=16)
for w, hgt, ch in ((640, 427, 3), (384, 303, 0), (600, 400, 3), (512, 512, 4)):
    shape = (hgt, w, ch) if ch else (hgt, w)
    h.update(demo.StandInEncoder().encode(rng.integers(0, 256, shape, dtype=np.uint8)).view(-1).view(
        __import__("torch").uint8).numpy().tobytes())
print(h.hexdigest())
"""


def test_stand_in_encoder_bytes_do_not_depend_on_the_cpu_kernels():
    """The demo verifies every hit against a recomputation, so the encoder must give the same bytes
    whatever kernels compute it: here torch's scalar (non-vectorised) kernels and MKL restricted to
    AVX2. The former float ``tanh(features @ P)`` gave other bytes under both (a vectorised vs
    scalar ``tanh``; MKL's AVX2 vs AVX-512 sgemm), so the demo could report a correct hit as a
    mismatch (once: 12 mismatches = every later hit of one entry, in ectier and the baseline alike).
    """
    import subprocess
    import sys

    def digest(**env):
        full = {**os.environ, **env}
        r = subprocess.run([sys.executable, "-c", _ENCODE_DIGESTS], env=full, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    base = digest()
    assert digest(ATEN_CPU_CAPABILITY="default") == base
    assert digest(MKL_ENABLE_INSTRUCTIONS="AVX2", OMP_NUM_THREADS="1") == base


def test_stand_in_encoder_arithmetic_is_exact():
    enc = demo.StandInEncoder()
    proj = enc.projection
    assert torch.equal(proj, proj.round()) and proj.abs().max() <= 255
    # features are integers 0..1020 over 51 terms: every partial sum of features @ P is exact in float32
    assert proj.shape[0] * 1020 * 255 < 2**24
    px = np.random.default_rng(1).integers(0, 256, (427, 640, 3), dtype=np.uint8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = enc.encode(px)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one.view(torch.int16), demo.StandInEncoder().encode(px).view(torch.int16))


def test_zipf_stream():
    a = demo.zipf_stream(10, 2000, 1.1, seed=7)
    assert a == demo.zipf_stream(10, 2000, 1.1, seed=7)
    assert a != demo.zipf_stream(10, 2000, 1.1, seed=8)
    counts = np.bincount(a, minlength=10)
    assert sorted(counts)[-1] > 4 * sorted(counts)[0]  # skewed
    uniform = np.bincount(demo.zipf_stream(10, 5000, 0.0, seed=1), minlength=10)
    assert uniform.min() > 350
    for args, field in (((0, 5, 1.0, 0), "images"), ((3, 0, 1.0, 0), "requests"), ((3, 5, -1.0, 0), "zipf"),
                        ((3, 5, float("nan"), 0), "zipf"), ((3, 10**11, 1.0, 0), "requests"),
                        ((3, 5, 1.0, -1), "seed")):
        with pytest.raises(ConfigError, match=field):
            demo.zipf_stream(*args)


def test_safetensors_baseline_layout_and_round_trip(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    store = demo.SafetensorsPerItemStore(tmp_path)
    key = "ab" * 32
    t = torch.randn(64, 8192).to(torch.bfloat16)
    assert not store.has(key)
    store.save(key, t)
    path = tmp_path / key / "encoder_cache.safetensors"
    assert store.has(key) and path.is_file()
    assert set(safetensors_torch.load_file(str(path))) == {"ec_cache"}
    back = store.load(key)
    assert back.dtype == t.dtype and torch.equal(back.view(torch.int16), t.view(torch.int16))
    with pytest.raises(FileNotFoundError):
        store.load("cd" * 32)


def test_same_bytes_is_bitwise():
    a = torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    b = torch.tensor([-0.0, 1.0], dtype=torch.bfloat16)
    assert torch.equal(a, b)  # equal as numbers ...
    assert not same_bytes(a, b)  # ... not as bytes
    assert same_bytes(a, a.clone())
    assert not same_bytes(a, a.to(torch.float16))
    assert not same_bytes(a, a.reshape(2, 1))
    odd = torch.arange(3, dtype=torch.uint8)
    assert same_bytes(odd, odd.clone()) and not same_bytes(odd, odd + 1)
