"""``ectier demo``: the main job — replay an image request stream through a :class:`TieredCache`.

Everything runs in this process on the CPU; nothing is downloaded and no daemon is started.

What happens, step by step
    1. **Images.** Real photographs that scikit-image ships inside its wheel (``skimage.data``:
       astronaut, camera, coffee, retina, ...) at their native sizes, plus three images at the
       sizes of the seed documents' worked examples (256x256, 1024x1024, 1920x1080) made by
       cropping and resizing real photographs. Without scikit-image the demo says so and uses
       deterministic synthetic pixels of the same sizes instead.
    2. **Keys.** Each image's ``mm_hash`` is a BLAKE2b-256 hex digest of its pixels (shape, dtype
       and bytes) — what vLLM does conceptually (it hashes the image with blake3).
    3. **Encoder outputs.** A deterministic stand-in encoder (:class:`StandInEncoder`) turns the
       pixels into the tensor the real model would produce: Qwen3-VL ``(N, 8192)`` bfloat16 with
       ``N`` from :func:`ectier.sizing.image_tokens`; Gemma 3 ``(256, 5376)`` bfloat16. It depends
       on every pixel and is bit-for-bit reproducible, so every cache hit is verified byte-exact
       against a fresh recomputation.
    4. **Stream.** ``requests`` draws from a Zipf-like popularity (``p(rank) ~ rank**-zipf``) over
       the images, ranks shuffled by ``seed``.
    5. **ectier.** A :class:`TieredCache` (host arena -> NVMe/LMDB) whose budgets are smaller than
       the working set (by default host 25 %, NVMe 60 % of the unique bytes), so entries are
       evicted, demoted to NVMe and promoted back. Miss: encode, ``put``. Hit: recompute, compare.
    6. **Baseline.** The same stream through :class:`SafetensorsPerItemStore`, which behaves like
       vLLM's in-tree ``ECExampleConnector`` (a safetensors file per ``mm_hash``, no eviction).
       Both stores serve each request back to back, in alternating order, so both are timed under
       the same conditions (allocator state, page cache, other load on the machine).
    7. **Report.** Per-tier counters (from :meth:`TieredCache.stats`), hit rates by items and
       bytes, GB/s inside the cache calls, encoder time spent and saved, ectier vs baseline.

Entry points: :func:`run_demo` (returns the summary dict), :func:`print_summary` (rich tables),
:class:`DemoOptions` (the report itself lives in :mod:`ectier.demo_report`). The ``ectier demo``
command in :mod:`ectier.cli` wires them to options.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .cache import TieredCache
from .config import CacheConfig, HostTierConfig, NvmeTierConfig
from .errors import ConfigError, EntryTooLargeError, TierWriteError
from .demo_report import print_summary
from .sizing import ModelSpec, get_model, image_tokens

__all__ = [
    "DemoImage",
    "DemoOptions",
    "SafetensorsPerItemStore",
    "StandInEncoder",
    "load_images",
    "mm_hash",
    "print_summary",
    "run_demo",
    "zipf_stream",
]

MiB = 1 << 20

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

#: Share of the working set's unique bytes that the default budgets give each tier.
DEFAULT_HOST_FRACTION = 0.25
DEFAULT_NVME_FRACTION = 0.60
# What the NVMe tier must have beyond an entry's raw bytes to admit it (header allowance).
_NVME_HEADROOM_BYTES = 4096 + 2 * 65536


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


def _import_skimage():
    """Return the ``skimage.data`` module; raises ImportError without scikit-image."""
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
        warn: called with a one-line message for each image skipped and for the fallback.

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
        data = _import_skimage()
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
    return (unique[:limit] if limit is not None else unique), origin


# =========================================================================== stand-in encoder


class StandInEncoder:
    """A cheap, deterministic function of the pixels with the real encoder's output shape and dtype.

    For an image it produces ``(N, embed_dim)`` of the model's dtype (Qwen3-VL: ``(N, 8192)``
    bfloat16, ``N = image_tokens(w, h).num_tokens``; Gemma 3: ``(256, 5376)`` bfloat16):

    1. pixels -> 3 channels (grey replicated, alpha dropped), as integers;
    2. area sums (an int64 integral image) over a ``(4*gh, 4*gw)`` grid with the cell bounds of
       ``adaptive_avg_pool2d``, ``gh x gw = N`` tokens laid out like the model's merged patches —
       every input pixel contributes; each cell's mean is kept as an integer ``0..1020``
       (``4 * sum // area``);
    3. each token's features = its 3 x 4 x 4 sub-patch means + (row, column, 1), all integers;
    4. ``y = features @ P`` with ``P`` a fixed-seed integer matrix ``(51, embed_dim)`` in
       ``-255..255``, then ``y / (|y| + 2**19)`` (a squashing into ``(-1, 1)``), cast to the model
       dtype.

    The verification of every cache hit relies on this being bit-for-bit reproducible, so no step
    may depend on how a kernel orders or vectorises its arithmetic: every product and partial sum
    of step 4 is an integer below ``2**24`` (exact in float32, in any order, with or without FMA,
    whatever BLAS kernel, thread count or alignment), and the squashing is one exactly rounded
    addition and one exactly rounded division per element. (The former ``tanh(features @ P)`` on
    float features was not: MKL's AVX2 and AVX-512 sgemm kernels, or a vectorised vs scalar
    ``tanh``, gave different bytes for the same pixels, so a hit could be reported as a mismatch.)
    Not thread-safe: one instance keeps two float32 scratch buffers of the largest output seen
    (``2 * N * embed_dim * 4`` bytes).

    Args:
        model: model name/alias or :class:`~ectier.sizing.ModelSpec` (default ``"qwen3-vl"``).
        seed: seed of the projection matrix.

    Raises:
        ConfigError: unknown model, or a dtype torch does not have.
    """

    SUB = 4  # sub-patches per token side

    def __init__(self, model: str | ModelSpec = "qwen3-vl", *, seed: int = 0) -> None:
        self.spec = get_model(model)
        dtype = getattr(torch, self.spec.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"model: dtype {self.spec.dtype!r} of {self.spec.name!r} is not a torch dtype")
        self.dtype = dtype
        features = 3 * self.SUB * self.SUB + 3
        gen = torch.Generator().manual_seed(seed)
        # integers in -255..255: with features in 0..1020, |y| <= 51 * 1020 * 255 < 2**24 (exact)
        self._proj = torch.randint(-255, 256, (features, self.spec.embed_dim), generator=gen).to(torch.float32)
        self._work = torch.empty(0, self.spec.embed_dim, dtype=torch.float32)
        self._den = torch.empty(0, self.spec.embed_dim, dtype=torch.float32)

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """Token grid ``(rows, columns)`` of a ``width x height`` image; ``rows * columns = N``."""
        spec = self.spec
        if spec.is_fixed:
            n = spec.fixed_tokens
            rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
            return rows, n // rows
        info = image_tokens(width, height, spec)
        return info.resized_height // spec.factor, info.resized_width // spec.factor

    def encode(self, pixels: np.ndarray) -> torch.Tensor:
        """Encoder output of one image.

        Args:
            pixels: ``uint8`` array ``(H, W)`` or ``(H, W, C)`` with ``C >= 3``.

        Returns:
            CPU tensor ``(N, embed_dim)`` of the model's dtype (contiguous, freshly allocated).

        Raises:
            ConfigError: pixels of another dtype or rank, or a size the model refuses.
        """
        if pixels.dtype != np.uint8 or pixels.ndim not in (2, 3) or (pixels.ndim == 3 and pixels.shape[2] < 3):
            raise ConfigError(f"pixels: expected uint8 (H, W) or (H, W, >=3), got {pixels.dtype} {pixels.shape}")
        height, width = pixels.shape[:2]
        rows, cols = self.grid(width, height)
        x = torch.from_numpy(np.ascontiguousarray(pixels))
        x = x.unsqueeze(-1).expand(-1, -1, 3) if x.dim() == 2 else x[:, :, :3]
        x = x.permute(2, 0, 1).to(torch.int64)  # (3, H, W), 0..255
        s = self.SUB
        gr, gc = rows * s, cols * s
        # integral image: exact int64 area sums over adaptive_avg_pool2d's cells
        ii = torch.zeros(3, height + 1, width + 1, dtype=torch.int64)
        ii[:, 1:, 1:] = x.cumsum(1).cumsum(2)
        i, j = torch.arange(gr), torch.arange(gc)
        y0, y1 = (i * height) // gr, -((-(i + 1) * height) // gr)
        x0, x1 = (j * width) // gc, -((-(j + 1) * width) // gc)
        sums = (ii[:, y1][:, :, x1] - ii[:, y0][:, :, x1] - ii[:, y1][:, :, x0] + ii[:, y0][:, :, x0])
        area = (y1 - y0)[:, None] * (x1 - x0)[None, :]
        pooled = (4 * sums) // area  # (3, rows*s, cols*s), integer means 0..1020
        feats = pooled.reshape(3, rows, s, cols, s).permute(1, 3, 0, 2, 4).reshape(rows * cols, 3 * s * s)
        r = ((torch.arange(rows) * 1020) // rows).repeat_interleave(cols)
        c = ((torch.arange(cols) * 1020) // cols).repeat(rows)
        feats = torch.cat([feats, r[:, None], c[:, None], torch.full((rows * cols, 1), 1020)], dim=1)
        n = rows * cols
        if self._work.shape[0] < n:  # float32 scratch reused across calls: no fresh pages per image
            self._work = torch.empty(n, self.spec.embed_dim, dtype=torch.float32)
            self._den = torch.empty(n, self.spec.embed_dim, dtype=torch.float32)
        out = self._work[:n]
        if torch.get_float32_matmul_precision() == "highest":
            torch.matmul(feats.to(torch.float32), self._proj, out=out)  # exact integers
        else:  # float32 matmuls may run in bf16/tf32: float64 never does (same exact integers)
            out.copy_(torch.matmul(feats.to(torch.float64), self._proj.to(torch.float64)))
        den = torch.abs(out, out=self._den[:n]).add_(float(1 << 19))  # exact: an integer < 2**24
        out.div_(den)  # one correctly rounded division per element
        return out.to(self.dtype, copy=True)


# ================================================================================== baseline


class SafetensorsPerItemStore:
    """Baseline store that mirrors the behaviour of vLLM's in-tree ``ECExampleConnector``.

    Written from that connector's documented behaviour (no vLLM code copied): one directory per
    ``mm_hash`` holding ``encoder_cache.safetensors`` with a single tensor named ``"ec_cache"``;
    save is ``tensor.cpu()`` + ``safetensors.torch.save_file``, synchronous, on pageable memory;
    load is ``safetensors.torch.load_file(path)["ec_cache"]``; presence is ``os.path.exists``;
    nothing is ever evicted (the directory grows without bound). Unlike ectier it turns the key
    into a file path.

    Args:
        root: directory for the per-item directories (created if missing).

    Raises:
        ImportError: safetensors is not installed.
    """

    FILENAME = "encoder_cache.safetensors"
    TENSOR_NAME = "ec_cache"

    def __init__(self, root: str | os.PathLike) -> None:
        import safetensors.torch as st

        self._st = st
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, mm_hash: str) -> str:
        """``{root}/{mm_hash}/encoder_cache.safetensors``."""
        return os.path.join(self.root, mm_hash, self.FILENAME)

    def has(self, mm_hash: str) -> bool:
        """True if a file exists for ``mm_hash`` (the connector's ``has_cache_item``)."""
        return os.path.exists(self.path(mm_hash))

    def save(self, mm_hash: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (any device) to its own safetensors file (the connector's ``save_caches``)."""
        path = self.path(mm_hash)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._st.save_file({self.TENSOR_NAME: tensor.cpu()}, path)

    def load(self, mm_hash: str, *, materialize: bool = True) -> torch.Tensor:
        """Read the tensor back (the connector's ``start_load_caches``). Raises FileNotFoundError.

        On the CPU, ``load_file`` returns a tensor backed by a lazy memory map of the file: no
        byte is read until first use. The connector loads with ``device=<cuda device>``, which reads
        every byte at load time; ``materialize`` (default) does the same on the CPU by copying the
        bytes out of the mapping (``clone``), so the read is counted as part of the load, as it is
        for ectier's ``get`` (which returns an owned copy).
        """
        tensor = self._st.load_file(self.path(mm_hash))[self.TENSOR_NAME]
        return tensor.clone() if materialize and tensor.device.type == "cpu" else tensor


# ==================================================================================== stream


def zipf_stream(num_items: int, requests: int, s: float, seed: int) -> list[int]:
    """Indices into ``range(num_items)`` drawn with Zipf-like popularity.

    The item at popularity rank ``r`` (1-based) is drawn with probability ``∝ r**-s``; which item
    gets which rank is a permutation drawn from ``seed``. ``s = 0`` is uniform. Deterministic for a
    given ``(num_items, requests, s, seed)``.

    Raises:
        ConfigError: ``num_items``/``requests`` below 1 or ``s`` negative or not finite.
    """
    if num_items < 1:
        raise ConfigError(f"images: need at least 1 image, got {num_items}")
    if requests < 1:
        raise ConfigError(f"requests: must be >= 1, got {requests}")
    if not math.isfinite(s) or s < 0:
        raise ConfigError(f"zipf: must be a finite number >= 0, got {s}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(num_items)  # order[rank - 1] = item
    weights = np.arange(1, num_items + 1, dtype=np.float64) ** -s
    ranks = rng.choice(num_items, size=requests, p=weights / weights.sum())
    return [int(order[r]) for r in ranks]


# ====================================================================================== run


@dataclass(frozen=True)
class DemoOptions:
    """Settings of one demo run (the ``ectier demo`` options).

    Fields:
        requests: number of requests in the stream (>= 1).
        zipf: popularity exponent (>= 0; ~1.1 is typical of image reuse, 0 is uniform).
        seed: seed of the stream.
        host_bytes: host tier budget in bytes; ``None`` = 25 % of the working set's unique bytes
            (at least the largest entry); 0 disables the host tier.
        nvme_bytes: NVMe tier budget in bytes; ``None`` = 60 % of the unique bytes (at least the
            largest entry plus header room); 0 disables the NVMe tier.
        dir: an existing parent directory for the run's stores (a fresh subdirectory, removed at
            the end; ``dir`` itself is never created); ``None`` = the system temp directory. Put it
            on the NVMe you want measured.
        codec: NVMe codec, ``"raw"``, ``"zstd"`` or ``"zstd-planes"``.
        sync: fsync every NVMe commit (the baseline never fsyncs; off by default to compare alike).
        baseline: also run the safetensors-file-per-item baseline.
        model: model name (``"qwen3-vl"`` default, ``"gemma3"``, or an alias).
        images: use only the first ``images`` images of the working set (``None`` = all).
        encoder_seed: seed of the stand-in encoder's projection.
    """

    requests: int = 300
    zipf: float = 1.1
    seed: int = 0
    host_bytes: Optional[int] = None
    nvme_bytes: Optional[int] = None
    dir: Optional[str] = None
    codec: str = "raw"
    sync: bool = False
    baseline: bool = True
    model: str = "qwen3-vl"
    images: Optional[int] = None
    encoder_seed: int = 0


def _gbps(nbytes: float, seconds: float) -> Optional[float]:
    return nbytes / seconds / 1e9 if seconds > 0 and nbytes > 0 else None


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-exact equality, including dtype and shape (NaN payloads and -0.0 compared as bits)."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.numel() == 0:
        return True
    a8 = a.contiguous().reshape(-1).view(torch.uint8)
    b8 = b.contiguous().reshape(-1).view(torch.uint8)
    for wide in (torch.int64, torch.int32):  # same bits, fewer elements: several times faster
        if a8.numel() % wide.itemsize == 0:
            try:
                return torch.equal(a8.view(wide), b8.view(wide))
            except RuntimeError:  # storage offset not aligned to the wider type
                break
    return torch.equal(a8, b8)


def _default_budgets(entry_bytes: list[int], opts: DemoOptions) -> tuple[int, int]:
    total = sum(entry_bytes)
    largest = max(entry_bytes)
    host = opts.host_bytes
    if host is None:
        host = max(int(total * DEFAULT_HOST_FRACTION), largest)
        host = -(-host // (256 * 1024)) * 256 * 1024  # whole arena blocks
    nvme = opts.nvme_bytes
    if nvme is None:
        nvme = max(int(total * DEFAULT_NVME_FRACTION), largest + _NVME_HEADROOM_BYTES)
        nvme = -(-nvme // MiB) * MiB
    if host == 0 and nvme == 0:
        raise ConfigError("host-bytes: host and NVMe budgets are both 0; no tier could store anything")
    return host, nvme


def _progress(console: Console, quiet: bool) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description:<24}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=console,
        disable=quiet,
    )


class _EctierSide:
    """The ectier half of the replay: ``get``; on a miss ``put`` (counts, bytes, seconds in the calls)."""

    def __init__(self, cache: TieredCache) -> None:
        self.cache = cache
        self.n = dict(hits=0, misses=0, host_hits=0, nvme_hits=0, mismatches=0, puts=0, put_refused=0)
        self.b = dict(requested=0, hit=0, host_hit=0, nvme_hit=0, put=0)
        self.t = dict(get=0.0, get_host=0.0, get_nvme=0.0, get_miss=0.0, put=0.0, encode_miss=0.0, encode_saved=0.0)
        self.refusals: dict[str, str] = {}  # error class -> first message
        self.mismatched: list[dict[str, Any]] = []

    def load(self, key: str) -> tuple[Optional[torch.Tensor], str]:
        host_before = self.cache.stats()["tiers"].get("host", {}).get("hits", 0)
        t0 = time.perf_counter()
        out = self.cache.get(key)
        dt = time.perf_counter() - t0
        self.t["get"] += dt
        if out is None:
            self.n["misses"] += 1
            self.t["get_miss"] += dt
            return None, ""
        nbytes = out.numel() * out.element_size()
        tier = "host" if self.cache.stats()["tiers"].get("host", {}).get("hits", 0) > host_before else "nvme"
        self.n["hits"] += 1
        self.n[f"{tier}_hits"] += 1
        self.b["hit"] += nbytes
        self.b[f"{tier}_hit"] += nbytes
        self.t[f"get_{tier}"] += dt
        return out, tier

    def save(self, key: str, tensor: torch.Tensor) -> None:
        t0 = time.perf_counter()
        try:
            self.cache.put(key, tensor)
        except (EntryTooLargeError, TierWriteError) as exc:
            # what a connector does: the entry is not cached, the request goes on
            self.t["put"] += time.perf_counter() - t0
            self.n["put_refused"] += 1
            self.refusals.setdefault(type(exc).__name__, str(exc))
            return
        self.t["put"] += time.perf_counter() - t0
        self.n["puts"] += 1
        self.b["put"] += tensor.numel() * tensor.element_size()

    def summary(self, requests: int) -> dict[str, Any]:
        n, b, t = self.n, self.b, self.t
        return {
            "requests": requests,
            "hits": n["hits"],
            "misses": n["misses"],
            "host_hits": n["host_hits"],
            "nvme_hits": n["nvme_hits"],
            "hit_rate": n["hits"] / requests,
            "requested_bytes": b["requested"],
            "hit_bytes": b["hit"],
            "byte_hit_rate": b["hit"] / b["requested"] if b["requested"] else 0.0,
            "host_hit_bytes": b["host_hit"],
            "nvme_hit_bytes": b["nvme_hit"],
            "puts": n["puts"],
            "put_bytes": b["put"],
            "put_refused": n["put_refused"],
            "put_refusal_reasons": self.refusals,
            "get_s": t["get"],
            "get_host_s": t["get_host"],
            "get_nvme_s": t["get_nvme"],
            "get_miss_s": t["get_miss"],
            "put_s": t["put"],
            "cache_s": t["get"] + t["put"],
            "get_gbps": _gbps(b["hit"], t["get"]),
            "get_host_gbps": _gbps(b["host_hit"], t["get_host"]),
            "get_nvme_gbps": _gbps(b["nvme_hit"], t["get_nvme"]),
            "put_gbps": _gbps(b["put"], t["put"]),
            "encoder_s": t["encode_miss"],
            "encoder_saved_s": t["encode_saved"],
            "mismatches": n["mismatches"],
            "mismatch_examples": self.mismatched,
        }


class _BaselineSide:
    """The safetensors-per-item half of the replay: ``has`` + ``load``; on a miss ``save``."""

    def __init__(self, store: SafetensorsPerItemStore) -> None:
        self.store = store
        self.hits = self.misses = self.mismatches = 0
        self.hit_bytes = self.save_bytes = 0
        self.load_s = self.save_s = self.encode_s = 0.0

    def load(self, key: str) -> Optional[torch.Tensor]:
        t0 = time.perf_counter()
        out = self.store.load(key) if self.store.has(key) else None
        self.load_s += time.perf_counter() - t0
        if out is None:
            self.misses += 1
        else:
            self.hits += 1
            self.hit_bytes += out.numel() * out.element_size()
        return out

    def save(self, key: str, tensor: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.store.save(key, tensor)
        self.save_s += time.perf_counter() - t0
        self.save_bytes += tensor.numel() * tensor.element_size()

    def summary(self, requests: int) -> dict[str, Any]:
        return {
            "requests": requests,
            "hits": self.hits,
            "misses": self.misses,
            "hit_bytes": self.hit_bytes,
            "save_bytes": self.save_bytes,
            "load_s": self.load_s,
            "save_s": self.save_s,
            "cache_s": self.load_s + self.save_s,
            "load_gbps": _gbps(self.hit_bytes, self.load_s),
            "save_gbps": _gbps(self.save_bytes, self.save_s),
            "encoder_s": self.encode_s,
            "mismatches": self.mismatches,
        }


def _replay(stream, images, encoder: StandInEncoder, ect: _EctierSide, base: Optional[_BaselineSide],
            progress: Progress) -> float:
    """Replay ``stream`` through ectier (and the baseline, request by request); returns wall seconds.

    Each request is served by both stores back to back, in alternating order, so that both see
    the same machine state (allocator, page cache, other load) and neither always goes first. The
    encoder runs once per request: on an ectier miss to produce the entry, on an ectier hit to
    recompute it for verification; the baseline reuses that tensor for its save or its check.
    """
    wall0 = time.perf_counter()
    what = "ectier + safetensors" if base is not None else "ectier (host → NVMe)"
    task = progress.add_task(what, total=len(stream), info="")
    for step, idx in enumerate(stream):
        img = images[idx]
        base_first = base is not None and step % 2 == 1
        base_out = base.load(img.mm_hash) if base_first else None
        out, tier = ect.load(img.mm_hash)
        if base is not None and not base_first:
            base_out = base.load(img.mm_hash)
        ect_missed, base_missed = out is None, base is not None and base_out is None
        t0 = time.perf_counter()
        ref = encoder.encode(img.pixels)  # a miss computes it; a hit saved exactly this work
        encode_s = time.perf_counter() - t0
        ect.b["requested"] += ref.numel() * ref.element_size()
        if ect_missed:
            ect.t["encode_miss"] += encode_s
        else:
            ect.t["encode_saved"] += encode_s
            if not _same_bytes(out, ref):
                ect.n["mismatches"] += 1
                if len(ect.mismatched) < 10:
                    ect.mismatched.append({"request": step, "image": img.name, "mm_hash": img.mm_hash, "tier": tier})
        if base is not None:
            if base_missed:
                base.encode_s += encode_s
            elif not _same_bytes(base_out, ref):
                base.mismatches += 1
        del out, base_out
        if base_first and base_missed:
            base.save(img.mm_hash, ref)
        if ect_missed:
            ect.save(img.mm_hash, ref)
        if base_missed and not base_first:
            base.save(img.mm_hash, ref)
        progress.update(task, advance=1, info=f"hits {ect.n['hits']}  mismatches {ect.n['mismatches']}")
    return time.perf_counter() - wall0


def _ratio(baseline_s: float, baseline_bytes: int, ectier_s: float, ectier_bytes: int) -> Optional[float]:
    """How many times faster ectier moves a byte than the baseline (seconds per byte ratio)."""
    if min(baseline_s, ectier_s) <= 0 or min(baseline_bytes, ectier_bytes) <= 0:
        return None
    return (baseline_s / baseline_bytes) / (ectier_s / ectier_bytes)


def run_demo(
    opts: DemoOptions = DemoOptions(),
    *,
    console: Optional[Console] = None,
    quiet: bool = False,
) -> dict[str, Any]:
    """Run the demo end to end and return its summary (JSON-serialisable dict).

    Args:
        opts: :class:`DemoOptions`.
        console: rich console for the progress bars and notes (default: a new stdout console).
        quiet: no progress bars, no notes.

    Returns:
        A dict with ``ok`` (no mismatch), ``mismatches`` (ectier + baseline), ``options``,
        ``images`` (name, source, width, height, tokens, nbytes, mm_hash, requests), ``budgets``,
        ``ectier`` (counts, bytes, seconds, GB/s — GB = 1e9 bytes — and ``stats``, the cache's
        :meth:`~ectier.TieredCache.stats`), ``baseline`` (or ``None``), ``speedup`` (baseline seconds
        per byte / ectier seconds per byte for ``load``, ``save`` and ``total``), ``replay_s`` (the
        replay loop) and ``wall_s`` (everything, image loading included), all in seconds.

    Raises:
        ConfigError: an invalid option (the message names it), e.g. an unknown model or codec, or
            a ``dir`` that is not an existing directory.
        EctierError: the cache could not be opened in ``opts.dir``.
    """
    wall0 = time.perf_counter()
    if opts.dir is not None and not os.path.isdir(opts.dir):
        # never create a directory the user named: a typo would leave a stray tree behind
        raise ConfigError(f"dir (--dir): {opts.dir!r} is not an existing directory; create it first "
                          "(the demo makes a fresh subdirectory inside it and removes that afterwards)")
    console = console if console is not None else Console()
    note = (lambda msg: None) if quiet else (lambda msg: console.print(f"[yellow]note:[/] {msg}", highlight=False))
    spec = get_model(opts.model)
    encoder = StandInEncoder(spec, seed=opts.encoder_seed)
    images, origin = load_images(opts.images, warn=note)
    stream = zipf_stream(len(images), opts.requests, opts.zipf, opts.seed)
    infos = []
    for img in images:
        tok = image_tokens(img.width, img.height, spec)
        infos.append(tok)
    entry_bytes = [tok.nbytes for tok in infos]
    host_bytes, nvme_bytes = _default_budgets(entry_bytes, opts)
    counts = np.bincount(np.asarray(stream), minlength=len(images))

    baseline_available = False
    if opts.baseline:
        try:
            import safetensors.torch  # noqa: F401
        except ImportError as exc:
            note(f"safetensors is not installed ({exc}); baseline skipped (pip install 'ectier[demo]')")
        else:
            baseline_available = True

    workdir = tempfile.mkdtemp(prefix="ectier-demo-", dir=opts.dir)
    try:
        config = CacheConfig(
            namespace=f"ectier-demo:{spec.name}:{spec.dtype}:stand-in-encoder-seed{opts.encoder_seed}",
            host=HostTierConfig(capacity_bytes=host_bytes),
            nvme=NvmeTierConfig(
                path=os.path.join(workdir, "ectier") if nvme_bytes > 0 else None,
                capacity_bytes=nvme_bytes if nvme_bytes > 0 else NvmeTierConfig.capacity_bytes,
                codec=opts.codec,
                sync=opts.sync,
                flush_on_close=False,  # the store is deleted after the run
            ),
        )
        with _progress(console, quiet) as progress, TieredCache(config) as cache:
            ect_side = _EctierSide(cache)
            base_side = None
            if baseline_available:
                base_side = _BaselineSide(SafetensorsPerItemStore(os.path.join(workdir, "safetensors")))
            replay_s = _replay(stream, images, encoder, ect_side, base_side, progress)
            ect = ect_side.summary(len(stream))
            ect["stats"] = cache.stats()
            base = base_side.summary(len(stream)) if base_side is not None else None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    speedup = None
    if base is not None:
        speedup = {
            "load": _ratio(base["load_s"], base["hit_bytes"], ect["get_s"], ect["hit_bytes"]),
            "save": _ratio(base["save_s"], base["save_bytes"], ect["put_s"], ect["put_bytes"]),
            "total": _ratio(base["cache_s"], base["hit_bytes"] + base["save_bytes"],
                            ect["cache_s"], ect["hit_bytes"] + ect["put_bytes"]),
        }
    mismatches = ect["mismatches"] + (base["mismatches"] if base else 0)
    options = asdict(opts)
    return {
        "ok": mismatches == 0,
        "mismatches": mismatches,
        "model": {"name": spec.name, "embed_dim": spec.embed_dim, "dtype": spec.dtype},
        "options": options,
        "image_source": origin,
        "images": [
            {"name": img.name, "source": img.source, "width": img.width, "height": img.height,
             "tokens": tok.num_tokens, "nbytes": tok.nbytes, "mm_hash": img.mm_hash, "requests": int(c)}
            for img, tok, c in zip(images, infos, counts)
        ],
        "unique_bytes": int(sum(entry_bytes)),
        "stream_unique_bytes": int(sum(nb for nb, c in zip(entry_bytes, counts) if c)),
        "budgets": {"host_bytes": host_bytes, "nvme_bytes": nvme_bytes, "codec": opts.codec,
                    "sync": opts.sync, "dir": opts.dir or tempfile.gettempdir()},
        "ectier": ect,
        "baseline": base,
        "speedup": speedup,
        "replay_s": replay_s,
        "wall_s": time.perf_counter() - wall0,
    }


def write_json(summary: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``summary`` to ``path`` as indented JSON (``-`` is not special: it is a file name)."""
    Path(path).write_text(json.dumps(summary, indent=2, sort_keys=False) + "\n", encoding="utf-8")
