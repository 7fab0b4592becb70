"""Tests for ectier.sizing: token math per model. The model registry, ``parse_size`` and the
modules' imports: test_sizing_models.py.

Expected numbers come from the project's background notes (docs/architecture.md, "The tensor":
the three worked examples, N in [64, 16384], Gemma3 256 x 5376) or are worked out by hand from
the documented smart_resize algorithm (transformers qwen2_vl image processor), with the working
shown next to each case — never computed by the code under test."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ectier.errors import ConfigError, EctierError
from ectier.sizing import (
    DEFAULT_MODEL,
    ImageTokens,
    get_model,
    image_tokens,
    max_tokens,
    min_tokens,
    smart_resize,
    tokens_to_nbytes,
)


MIN_PIXELS = 65536
MAX_PIXELS = 16777216


# --------------------------------------------------------------------------------------------
# Worked examples of docs/architecture.md, "The tensor" (must come out exactly)
# --------------------------------------------------------------------------------------------

# (W, H) -> (resized W, resized H, grid_h, grid_w, patches, N, bytes)
WORKED = [
    ((1024, 1024), (1024, 1024, 64, 64, 4096, 1024, 16_777_216)),
    ((1920, 1080), (1920, 1088, 68, 120, 8160, 2040, 33_423_360)),
    ((256, 256), (256, 256, 16, 16, 256, 64, 1_048_576)),
]


@pytest.mark.parametrize(("size", "expected"), WORKED, ids=["1024x1024", "1920x1080", "256x256"])
def test_worked_examples(size, expected):
    w, h = size
    rw, rh, gh, gw, patches, n, nbytes = expected
    t = image_tokens(w, h)
    assert isinstance(t, ImageTokens)
    assert t.model == "qwen3-vl"
    assert (t.width, t.height) == (w, h)
    assert (t.resized_width, t.resized_height) == (rw, rh)
    assert (t.grid_t, t.grid_h, t.grid_w) == (1, gh, gw)
    assert t.num_patches == patches
    assert t.num_tokens == n
    assert t.shape == (n, 8192)
    assert t.dtype == "bfloat16"
    assert t.nbytes == nbytes


def test_smart_resize_takes_height_first_like_transformers():
    # 1920 wide x 1080 high: the height (1080) is the side that moves to 1088.
    assert smart_resize(1080, 1920) == (1088, 1920)
    assert smart_resize(1920, 1080) == (1920, 1088)


def test_image_tokens_takes_width_first():
    t = image_tokens(1080, 1920)  # a portrait image: 1080 wide, 1920 high
    assert (t.resized_width, t.resized_height) == (1088, 1920)
    assert (t.grid_h, t.grid_w) == (120, 68)
    assert t.num_tokens == 2040


def test_default_model_is_qwen3_vl():
    assert DEFAULT_MODEL == "qwen3-vl"
    spec = get_model(DEFAULT_MODEL)
    assert spec.name == "qwen3-vl"
    assert spec.embed_dim == 8192
    assert spec.dtype == "bfloat16"
    assert spec.itemsize == 2
    assert (spec.patch_size, spec.merge_size, spec.temporal_patch_size) == (16, 2, 2)
    assert (spec.min_pixels, spec.max_pixels) == (MIN_PIXELS, MAX_PIXELS)
    assert spec.factor == 32


# --------------------------------------------------------------------------------------------
# Rounding, clamps and aspect ratio — hand-derived from the algorithm
# --------------------------------------------------------------------------------------------


def test_round_half_to_even_like_python_round():
    # 1040 / 32 = 32.5 -> Python round -> 32 -> 1024 (half-up would give 1056).
    assert smart_resize(1040, 1040) == (1024, 1024)
    # 1072 / 32 = 33.5 -> round -> 34 -> 1088.
    assert smart_resize(1072, 1072) == (1088, 1088)
    # 1087 / 32 = 33.97 -> 34 -> 1088; 1055 / 32 = 32.97 -> 33 -> 1056.
    assert smart_resize(1087, 1055) == (1088, 1056)


@pytest.mark.parametrize("side", [1, 2, 10, 31, 100, 255])
def test_min_clamp_square(side):
    # Any square below 256x256 is scaled up to exactly 256x256 = 65536 pixels: 64 tokens.
    assert smart_resize(side, side) == (256, 256)
    t = image_tokens(side, side)
    assert (t.resized_width, t.resized_height) == (256, 256)
    assert t.num_tokens == 64
    assert t.nbytes == 1_048_576


def test_min_clamp_non_square():
    # H=100, W=300: rounds to 96 x 288 = 27648 < 65536 -> ceil branch,
    # beta = sqrt(65536 / 30000) = 1.47802; 100*beta = 147.8 -> /32 = 4.62 -> 5 -> 160;
    # 300*beta = 443.4 -> /32 = 13.86 -> 14 -> 448. 160*448 = 71680 >= 65536; N = 5*14 = 70.
    assert smart_resize(100, 300) == (160, 448)
    t = image_tokens(300, 100)
    assert t.num_tokens == 70
    assert t.nbytes == 70 * 16384


def test_side_under_half_factor_rounds_to_zero_then_ceil_branch():
    # transformers (5.24.0) rounds without max(factor, .): H=11, W=2032 (ratio 184.7 <= 200).
    # round(11/32) = 0 -> 0, so 0 * 2048 < 65536 -> ceil branch from the *input* size:
    # beta = sqrt(65536 / (11*2032)) = 1.712308; 11*beta = 18.84 -> /32 = 0.589 -> 1 -> 32;
    # 2032*beta = 3479.4 -> /32 = 108.73 -> 109 -> 3488. N = 1 * 109 = 109.
    # (qwen-vl-utils' variant, which clamps the rounding to 32, would give 32 x 2048.)
    assert smart_resize(11, 2032) == (32, 3488)
    t = image_tokens(2032, 11)
    assert (t.resized_width, t.resized_height) == (3488, 32)
    assert t.num_tokens == 109


@pytest.mark.parametrize("side", [4097, 5000, 20000, 100000])
def test_max_clamp_square(side):
    h, w = smart_resize(side, side)
    assert h * w <= MAX_PIXELS
    assert h % 32 == 0 and w % 32 == 0
    t = image_tokens(side, side)
    assert 64 <= t.num_tokens <= 16384
    assert t.nbytes <= 256 * 1024 * 1024


def test_max_clamp_exact_value():
    # H=6000, W=8000 rounds to 6016 x 8000 = 48,128,000 > 16,777,216 -> floor branch,
    # beta = sqrt(48e6 / 16777216) = 1.691455; 6000/beta = 3547.3 -> /32 = 110.85 -> 110 -> 3520;
    # 8000/beta = 4729.7 -> /32 = 147.80 -> 147 -> 4704. N = 110 * 147 = 16170.
    assert smart_resize(6000, 8000) == (3520, 4704)
    t = image_tokens(8000, 6000)
    assert t.num_tokens == 16170
    assert t.nbytes == 16170 * 8192 * 2


def test_4096_square_is_the_largest_entry():
    # 4096 x 4096 = 16777216 = max_pixels exactly: kept as is, N = 128 * 128 = 16384 (256 MiB).
    t = image_tokens(4096, 4096)
    assert (t.resized_width, t.resized_height) == (4096, 4096)
    assert t.num_tokens == 16384
    assert t.nbytes == 268_435_456


def test_aspect_ratio_200_accepted():
    # W=200, H=1: ratio exactly 200. Ceil branch, beta = sqrt(65536/200) = 18.1019;
    # H: 18.10 -> /32 = 0.57 -> 1 -> 32; W: 3620.4 -> /32 = 113.14 -> 114 -> 3648. N = 114.
    assert smart_resize(1, 200) == (32, 3648)
    assert smart_resize(200, 1) == (3648, 32)
    t = image_tokens(200, 1)
    assert (t.resized_width, t.resized_height) == (3648, 32)
    assert t.num_tokens == 114
    # Large image at exactly 200:1 is also accepted.
    assert image_tokens(40000, 200).num_tokens > 0


@pytest.mark.parametrize(("w", "h"), [(201, 1), (1, 201), (20100, 100), (100, 20001)])
def test_aspect_ratio_above_200_rejected(w, h):
    with pytest.raises(ConfigError, match="aspect ratio") as excinfo:
        image_tokens(w, h)
    assert "200" in str(excinfo.value)
    assert "processor" in str(excinfo.value)
    with pytest.raises(ValueError):
        smart_resize(h, w)


def test_aspect_ratio_irrelevant_for_fixed_token_model():
    assert image_tokens(201, 1, model="gemma3").num_tokens == 256


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((0, 10), "height"),
        ((10, 0), "width"),
        ((-5, 10), "height"),
        ((10, -1), "width"),
        ((10.0, 10), "height"),
        ((10, "10"), "width"),
        ((True, 10), "height"),
        ((10, None), "width"),
    ],
)
def test_smart_resize_rejects_bad_sizes(args, name):
    with pytest.raises(ConfigError, match=name):
        smart_resize(*args)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"factor": 0}, "factor"),
        ({"min_pixels": 0}, "min_pixels"),
        ({"max_pixels": -1}, "max_pixels"),
        ({"min_pixels": 1000, "max_pixels": 999}, "min_pixels"),
    ],
)
def test_smart_resize_rejects_bad_parameters(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        smart_resize(100, 100, **kwargs)


@pytest.mark.parametrize(("w", "h", "name"), [(0, 5, "width"), (5, 0, "height"), (1.5, 5, "width")])
def test_image_tokens_rejects_bad_sizes(w, h, name):
    with pytest.raises(ConfigError, match=name):
        image_tokens(w, h)
    with pytest.raises(ConfigError, match=name):
        image_tokens(w, h, model="gemma3")


def test_errors_are_ectier_and_value_errors():
    with pytest.raises(EctierError):
        smart_resize(0, 1)
    with pytest.raises(ValueError):
        smart_resize(0, 1)


def test_floor_branch_keeps_at_least_one_factor():
    # Small budget, narrow image (factor 28, max_pixels 20*28*28 = 15680), H=639, W=31:
    # round -> 644 x 28 = 18032 > 15680 -> floor branch, beta = sqrt(19809/15680) = 1.12398;
    # 639/beta = 568.5 -> /28 = 20.3 -> 20 -> 560; 31/beta = 27.58 -> /28 = 0.985 -> 0,
    # lifted to 28 by max(factor, .). Result 560 x 28 = 15680.
    assert smart_resize(639, 31, factor=28, min_pixels=3136, max_pixels=15680) == (560, 28)
    assert smart_resize(31, 639, factor=28, min_pixels=3136, max_pixels=15680) == (28, 560)


def test_smart_resize_other_factor():
    # Qwen2-VL style factor 28 (patch 14 x merge 2): 1000 / 28 = 35.7 -> 36 -> 1008;
    # 500 / 28 = 17.86 -> 18 -> 504.
    assert smart_resize(500, 1000, factor=28, min_pixels=3136, max_pixels=12845056) == (504, 1008)


# --------------------------------------------------------------------------------------------
# Fixed-token model
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gemma3", "google/gemma-3-27b-it", "GEMMA3"])
@pytest.mark.parametrize(("w", "h"), [(1, 1), (896, 896), (1920, 1080), (20000, 100)])
def test_gemma3_fixed_tokens(name, w, h):
    t = image_tokens(w, h, model=name)
    assert t.model == "gemma3"
    assert (t.width, t.height) == (w, h)
    assert t.num_tokens == 256
    assert t.shape == (256, 5376)
    assert t.dtype == "bfloat16"
    assert t.nbytes == 2_752_512
    assert t.resized_width is None and t.resized_height is None
    assert t.grid_t is None and t.grid_h is None and t.grid_w is None
    assert t.num_patches is None


def test_gemma3_token_bounds_and_bytes():
    assert min_tokens("gemma3") == 256
    assert max_tokens("gemma3") == 256
    assert tokens_to_nbytes(256, model="gemma3") == 2_752_512


# --------------------------------------------------------------------------------------------
# Token bounds and bytes
# --------------------------------------------------------------------------------------------


def test_qwen3_vl_token_bounds():
    assert max_tokens("qwen3-vl") == 16384
    assert min_tokens("qwen3-vl") == 64
    assert max_tokens() == 16384
    assert min_tokens() == 64


def test_tokens_to_nbytes():
    assert tokens_to_nbytes(1024) == 16_777_216
    assert tokens_to_nbytes(2040) == 33_423_360
    assert tokens_to_nbytes(64, model="qwen3_vl_moe") == 1_048_576
    assert tokens_to_nbytes(16384) == 268_435_456
    assert tokens_to_nbytes(0) == 0


@pytest.mark.parametrize("bad", [-1, 1.0, "64", None, True])
def test_tokens_to_nbytes_rejects_bad_counts(bad):
    with pytest.raises(ConfigError, match="num_tokens"):
        tokens_to_nbytes(bad)


# --------------------------------------------------------------------------------------------
# Properties (Hypothesis)
# --------------------------------------------------------------------------------------------


@st.composite
def image_sizes(draw, max_side=100_000):
    """(width, height) with long side / short side <= 200."""
    short = draw(st.integers(1, max_side // 200 if max_side >= 200 else 1) | st.integers(1, max_side))
    long_ = draw(st.integers(short, min(max_side, short * 200)))
    if draw(st.booleans()):
        return short, long_
    return long_, short


@settings(max_examples=500, deadline=None)
@given(image_sizes())
def test_property_qwen3_vl(size):
    w, h = size
    t = image_tokens(w, h)
    rw, rh = t.resized_width, t.resized_height
    assert rw % 32 == 0 and rh % 32 == 0
    # With Qwen3-VL's bounds the algorithm always lands in [min_pixels, max_pixels].
    assert MIN_PIXELS <= rw * rh <= MAX_PIXELS
    assert t.grid_t == 1
    assert t.grid_h * 16 == rh and t.grid_w * 16 == rw
    assert t.num_patches == t.grid_h * t.grid_w
    assert t.num_patches == 4 * t.num_tokens
    assert t.num_tokens * 1024 == rw * rh
    assert 64 <= t.num_tokens <= 16384
    assert t.shape == (t.num_tokens, 8192)
    assert t.nbytes == t.num_tokens * 8192 * 2
    assert tokens_to_nbytes(t.num_tokens) == t.nbytes


@settings(max_examples=300, deadline=None)
@given(image_sizes(max_side=20_000))
def test_property_in_range_images_only_round(size):
    # When rounding alone lands in range, the result is just the rounded sides.
    w, h = size
    rounded_h = round(h / 32) * 32
    rounded_w = round(w / 32) * 32
    assume(MIN_PIXELS <= rounded_h * rounded_w <= MAX_PIXELS)
    assert smart_resize(h, w) == (rounded_h, rounded_w)
    assert abs(rounded_h - h) <= 16 and abs(rounded_w - w) <= 16
    assert rounded_h >= 32 and rounded_w >= 32


@settings(max_examples=500, deadline=None)
@given(
    image_sizes(),
    st.sampled_from([14, 16, 28, 32]),
    st.integers(1, 4_000_000),
    st.integers(0, 40_000_000),
)
def test_property_branch_guarantees_other_bounds(size, factor, min_pixels, extra):
    # What the algorithm guarantees per branch, for arbitrary bounds with max >= 200 * factor**2
    # (so the scaled short side is >= factor and max(factor, .) never lifts the floor branch):
    # - rounded product > max: floor branch, result <= max_pixels and <= the rounded product;
    # - rounded product < min: ceil branch, result >= min_pixels;
    # - otherwise the rounded sides are returned.
    w, h = size
    max_pixels = max(min_pixels, 200 * factor * factor) + extra
    rh, rw = smart_resize(h, w, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    assert rh % factor == 0 and rw % factor == 0 and rh >= factor and rw >= factor
    rounded_h = round(h / factor) * factor  # no max(factor, .) at this step, as in transformers
    rounded_w = round(w / factor) * factor
    if rounded_h * rounded_w > max_pixels:
        assert rh * rw <= max_pixels
        assert rh * rw < rounded_h * rounded_w
    elif rounded_h * rounded_w < min_pixels:
        assert rh * rw >= min_pixels
    else:
        assert (rh, rw) == (rounded_h, rounded_w)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 100_000), st.integers(1, 100_000))
def test_property_aspect_limit(w, h):
    ratio_ok = max(w, h) <= 200 * min(w, h)
    if ratio_ok:
        assert image_tokens(w, h).num_tokens >= 64
    else:
        with pytest.raises(ConfigError, match="aspect ratio"):
            image_tokens(w, h)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**7))
def test_property_tokens_to_nbytes(n):
    assert tokens_to_nbytes(n) == n * 16384
    assert tokens_to_nbytes(n, model="gemma3") == n * 10752
