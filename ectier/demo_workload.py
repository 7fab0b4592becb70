"""The ``ectier demo`` workload: its working set of images, their keys, and the request stream.

- :func:`load_images`: real photographs that scikit-image ships inside its wheel
  (``skimage.data``) at their native sizes, plus three images at the sizes of the seed documents'
  worked examples (256x256, 1024x1024, 1920x1080) made by cropping and resizing real photographs;
  without scikit-image, deterministic synthetic pixels of the same sizes.
- :func:`mm_hash`: an image's cache key, a BLAKE2b-256 hex digest of its pixels.
- :func:`zipf_stream`: image indices drawn with Zipf-like popularity.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from .bench.limits import check_stream
from .errors import ConfigError

__all__ = ["DemoImage", "SEED_SIZES", "SKIMAGE_PHOTOS", "load_images", "mm_hash", "skimage_data", "zipf_stream"]

#: Photographs scikit-image ships inside its wheel (no download needed), in display order.
SKIMAGE_PHOTOS = (
    "astronaut", "camera", "chelsea", "coffee", "rocket", "coins", "hubble_deep_field",
    "immunohistochemistry", "retina", "page", "text", "moon", "brick", "grass", "gravel",
    "colorwheel", "clock", "cell",
)

#: The seed documents' worked examples, (width, height, source photograph) — made from real pixels.
SEED_SIZES = ((256, 256, "astronaut"), (1024, 1024, "retina"), (1920, 1080, "hubble_deep_field"))

#: Native (height, width, channels) of the photographs above; the synthetic fallback uses them.
_FALLBACK_SHAPES = {
    "astronaut": (512, 512, 3), "camera": (512, 512, 1), "chelsea": (300, 451, 3),
    "coffee": (400, 600, 3), "rocket": (427, 640, 3), "coins": (303, 384, 1),
    "hubble_deep_field": (872, 1000, 3), "immunohistochemistry": (512, 512, 3),
    "retina": (1411, 1411, 3), "page": (191, 384, 1), "text": (172, 448, 1), "moon": (512, 512, 1),
    "brick": (512, 512, 1), "grass": (512, 512, 1), "gravel": (512, 512, 1),
    "colorwheel": (370, 371, 3), "clock": (300, 400, 1), "cell": (660, 550, 1),
}


# ============================================================================================ images


@dataclass(frozen=True)
class DemoImage:
    """One image of the demo's working set.

    Attributes:
        name: e.g. ``"coffee"`` or ``"retina@1024x1024"``.
        source: ``"skimage"`` (a photograph as shipped), ``"skimage-resized"`` (cropped/resized
            photograph at a seed size) or ``"synthetic"`` (deterministic generated pixels).
        pixels: ``uint8`` array, ``(H, W)`` grey or ``(H, W, C)`` with ``C >= 3`` (RGB first).
        mm_hash: :func:`mm_hash` of ``pixels`` (64 hex digits).
    """

    name: str
    source: str
    pixels: np.ndarray
    mm_hash: str

    @property
    def width(self) -> int:
        """Width in pixels."""
        return int(self.pixels.shape[1])

    @property
    def height(self) -> int:
        """Height in pixels."""
        return int(self.pixels.shape[0])


def mm_hash(pixels: np.ndarray) -> str:
    """The cache key of an image: BLAKE2b-256 hex digest of its pixels' shape, dtype and bytes.

    vLLM's ``mm_hash`` is conceptually the same thing (a hash of the image content; vLLM uses
    blake3, which may not be installed here). Returns 64 lowercase hex digits.
    """
    h = hashlib.blake2b(digest_size=32)
    h.update(f"{pixels.dtype.str}|{'x'.join(map(str, pixels.shape))}|".encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.hexdigest()


def _to_uint8(arr: np.ndarray) -> np.ndarray:
    """Image array (bool, float in [0, 1], uint8; grey, RGB or RGBA) -> uint8 ``(H, W)`` or ``(H, W, 3)``."""
    if arr.dtype == bool:
        arr = arr.astype(np.uint8) * 255
    elif arr.dtype != np.uint8:
        arr = np.clip(np.rint(np.asarray(arr, dtype=np.float64) * 255.0), 0, 255).astype(np.uint8)
    if arr.ndim == 3 and arr.shape[2] > 3:
        arr = arr[:, :, :3]
    return np.ascontiguousarray(arr)


def _center_crop_resize(img: np.ndarray, width: int, height: int) -> np.ndarray:
    """Crop ``img`` to the aspect ratio of ``width x height`` (centred), then resize to it.

    Bilinear with antialiasing (torch), deterministic; returns uint8 with ``img``'s channels.
    """
    h, w = img.shape[:2]
    target = width / height
    if w / h > target:
        cw, ch = max(1, round(h * target)), h
    else:
        cw, ch = w, max(1, round(w / target))
    y0, x0 = (h - ch) // 2, (w - cw) // 2
    crop = torch.from_numpy(np.ascontiguousarray(img[y0 : y0 + ch, x0 : x0 + cw]))
    grey = crop.dim() == 2
    x = (crop.unsqueeze(-1) if grey else crop).permute(2, 0, 1).unsqueeze(0).to(torch.float32)
    y = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False, antialias=True)
    out = y[0].round_().clamp_(0, 255).to(torch.uint8).permute(1, 2, 0)
    return np.ascontiguousarray((out[:, :, 0] if grey else out).numpy())


def skimage_data():
    """The ``skimage.data`` module: where :func:`load_images` takes its photographs from (each one
    a loader function named as in :data:`SKIMAGE_PHOTOS`; some need a download, which
    :func:`load_images` skips). Raises ImportError without scikit-image."""
    import skimage.data

    return skimage.data


def _synthetic_pixels(name: str, height: int, width: int, channels: int) -> np.ndarray:
    """Deterministic stand-in pixels (smooth waves + noise), seeded by ``name``; uint8."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]
    planes = []
    for _ in range(channels):
        fy, fx, phase = rng.uniform(1.0, 12.0, 3)
        wave = 0.5 + 0.35 * np.sin(2 * np.pi * (fy * y + fx * x) + phase)
        noise = rng.normal(0.0, 0.08, (height, width)).astype(np.float32)
        planes.append(np.clip(wave + noise, 0.0, 1.0))
    arr = np.stack(planes, axis=-1) if channels > 1 else planes[0]
    return np.rint(arr * 255.0).astype(np.uint8)


def load_images(
    limit: Optional[int] = None, *, warn: Callable[[str], None] = lambda msg: None
) -> tuple[list[DemoImage], str]:
    """Build the demo's working set.

    Args:
        limit: keep only the first ``limit`` images (photographs first, then the seed sizes).
        warn: called with a one-line message for each image skipped, for the fallback, and for a
            ``limit`` above the images there are (all of them are used).

    Returns:
        ``(images, origin)``: the images (distinct ``mm_hash`` each) and ``"scikit-image"`` or
        ``"synthetic"`` (scikit-image missing or no photograph loadable without network).

    Raises:
        ConfigError: ``limit`` below 1.
    """
    if limit is not None and limit < 1:
        raise ConfigError(f"images: must be >= 1, got {limit}")
    photos: dict[str, np.ndarray] = {}
    data = None
    try:
        data = skimage_data()
    except ImportError as exc:
        warn(f"scikit-image is not installed ({exc}); using deterministic synthetic pixels instead "
             f"(pip install 'ectier[demo]' for real photographs)")
    else:
        for name in SKIMAGE_PHOTOS:
            loader = getattr(data, name, None)
            if loader is None:
                warn(f"skimage.data.{name} does not exist in this scikit-image; skipped")
                continue
            try:
                photos[name] = _to_uint8(loader())
            # A file not in the wheel needs pooch (ImportError) and a download (OSError covers
            # ConnectionError, URLError, requests' errors); either way: skip, never hang on it.
            except (ImportError, OSError) as exc:
                warn(f"skimage.data.{name} needs a download ({type(exc).__name__}); skipped")
    images: list[DemoImage] = []
    if photos:
        origin = "scikit-image"
        for name, px in photos.items():
            images.append(DemoImage(name, "skimage", px, mm_hash(px)))
        for width, height, src in SEED_SIZES:
            src_name = src if src in photos else next(iter(photos))
            base = photos[src_name]
            px = _center_crop_resize(base, width, height)
            images.append(DemoImage(f"{src_name}@{width}x{height}", "skimage-resized", px, mm_hash(px)))
    else:
        if data is not None:
            warn("no scikit-image photograph could be loaded without network; using synthetic pixels")
        origin = "synthetic"
        for name, (h, w, c) in _FALLBACK_SHAPES.items():
            px = _synthetic_pixels(name, h, w, c)
            images.append(DemoImage(f"synthetic-{name}", "synthetic", px, mm_hash(px)))
        for width, height, _ in SEED_SIZES:
            px = _synthetic_pixels(f"seed-{width}x{height}", height, width, 3)
            images.append(DemoImage(f"synthetic@{width}x{height}", "synthetic", px, mm_hash(px)))
    seen: set[str] = set()
    unique = []
    for img in images:
        if img.mm_hash not in seen:  # identical pixels are one entry, as in vLLM
            seen.add(img.mm_hash)
            unique.append(img)
    if limit is not None and limit > len(unique):
        warn(f"images: {limit} asked for, the working set has {len(unique)}; using all {len(unique)}")
    return (unique[:limit] if limit is not None else unique), origin


# ==================================================================================== stream


def zipf_stream(num_items: int, requests: int, s: float, seed: int) -> list[int]:
    """Indices into ``range(num_items)`` drawn with Zipf-like popularity.

    The item at popularity rank ``r`` (1-based) is drawn with probability ``∝ r**-s``; which item
    gets which rank is a permutation drawn from ``seed``. ``s = 0`` is uniform. Deterministic for a
    given ``(num_items, requests, s, seed)``.

    Raises:
        ConfigError: ``num_items`` below 1, ``requests`` outside ``[1, MAX_REQUESTS]``
            (:data:`ectier.bench.limits.MAX_REQUESTS`), ``seed`` negative, or ``s`` negative or
            not finite.
    """
    if num_items < 1:
        raise ConfigError(f"images: need at least 1 image, got {num_items}")
    check_stream(requests, seed)
    if not math.isfinite(s) or s < 0:
        raise ConfigError(f"zipf: must be a finite number >= 0, got {s}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(num_items)  # order[rank - 1] = item
    weights = np.arange(1, num_items + 1, dtype=np.float64) ** -s
    ranks = rng.choice(num_items, size=requests, p=weights / weights.sum())
    return [int(order[r]) for r in ranks]
