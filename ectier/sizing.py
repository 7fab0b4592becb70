"""Token math: how many vision tokens an image becomes, and how many bytes its encoder output takes.

Pure Python (standard library only, no ``torch``), so the CLI, the config checker and the daemon
can size entries without loading a GPU stack.

What an entry is
    A vision encoder turns one image into a 2-D tensor of shape ``(N, embed_dim)`` — ``N`` vision
    tokens, each ``embed_dim`` elements of one ``dtype`` (``itemsize`` bytes each). Its size in
    bytes is ``N * embed_dim * itemsize``. ``N`` depends on the model and, for patch-grid models,
    on the image's size in pixels.

Patch-grid models (Qwen2-VL family, reference: Qwen3-VL-30B-A3B-Instruct)
    The image is resized by :func:`smart_resize` so both sides are multiples of
    ``factor = patch_size * merge_size`` (Qwen3-VL: 16 x 2 = 32 pixels) and its pixel count lies
    in ``[min_pixels, max_pixels]`` (Qwen3-VL: ``[65536, 16777216]``). Then, for a still image,
    ``grid_t = 1`` (the single frame is repeated to ``temporal_patch_size`` = 2 frames),
    ``grid_h = H' / patch_size``, ``grid_w = W' / patch_size``,
    ``num_patches = grid_t * grid_h * grid_w`` and ``N = num_patches / merge_size**2``
    (= ``(H'/32) * (W'/32)`` for Qwen3-VL). Qwen3-VL's output is ``(N, 8192)`` bfloat16: the main
    merger's 2048 columns plus three deepstack mergers' 2048 each, concatenated by vLLM; so one
    entry is ``N * 8192 * 2`` bytes, from 64 tokens (1 MiB) to 16384 tokens (256 MiB).

Fixed-token models (Gemma 3)
    Every image becomes the same number of tokens whatever its size: Gemma 3 27B gives
    ``(256, 5376)`` bfloat16 = 2,752,512 bytes per image.

Sources: token math follows Qwen3-VL's ``smart_resize`` (factor 32 = patch 16 x merge 2), i.e. the
algorithm of ``transformers.models.qwen2_vl.image_processing_qwen2_vl.smart_resize`` and the grid
arithmetic of that image processor; widths, dtypes and pixel bounds are those of docs/architecture.md
("The tensor"), whose worked examples are tests (tests/test_sizing.py).

Conventions: user-facing sizes are **width first** (``"1920x1080"`` is W x H, and
:func:`image_tokens` takes ``(width, height)``), while :func:`smart_resize` takes and returns
``(height, width)`` exactly like transformers. Every error raised on purpose is an
:class:`ectier.errors.ConfigError` (a ``ValueError``) whose message names the argument at fault.
"""

from __future__ import annotations

import math
import numbers
import re
import threading
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional, Tuple, Union

from .entry import DTYPE_ITEMSIZE
from .errors import ConfigError

__all__ = [
    "DEFAULT_MODEL",
    "MAX_ASPECT_RATIO",
    "MODELS",
    "ImageTokens",
    "ModelSpec",
    "get_model",
    "image_tokens",
    "max_tokens",
    "min_tokens",
    "parse_size",
    "register_model",
    "smart_resize",
    "tokens_to_nbytes",
]

#: Name of the model assumed when none is given: Qwen3-VL (``(N, 8192)`` bfloat16).
DEFAULT_MODEL = "qwen3-vl"

#: Largest ``long side / short side`` the Qwen2-VL-family image processor accepts.
MAX_ASPECT_RATIO = 200

# Bytes per element of the dtypes we know by name; a ModelSpec naming one of these must agree.
_DTYPE_ITEMSIZE = DTYPE_ITEMSIZE


def _check_int(value: object, name: str, *, minimum: int = 1) -> int:
    """Return ``value`` as an ``int`` if it is an integer ``>= minimum``; else raise ConfigError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if value < minimum:
        what = "positive" if minimum == 1 else f">= {minimum}"
        raise ConfigError(f"{name} must be {what}, got {value}")
    return value


def smart_resize(
    height: int,
    width: int,
    factor: int = 32,
    min_pixels: int = 65536,
    max_pixels: int = 16777216,
) -> Tuple[int, int]:
    """Size (in pixels) a Qwen2-VL-family processor resizes a ``height x width`` image to.

    Same algorithm as ``transformers.models.qwen2_vl.image_processing_qwen2_vl.smart_resize``
    (checked against transformers 5.24.0; the Qwen3-VL image processor uses that function,
    unlike ``qwen-vl-utils``, whose rounding step also clamps to ``factor``);
    defaults are Qwen3-VL's (factor 32 = patch 16 x merge 2, pixels in ``[65536, 16777216]``):

    1. round each side to the nearest multiple of ``factor`` (Python ``round``: halves go to the
       even multiple, e.g. 1040 -> 1024; a side under ``factor/2`` rounds to 0, which sends the
       image to step 3);
    2. if that has more than ``max_pixels`` pixels, scale both input sides by
       ``1/beta``, ``beta = sqrt(height*width / max_pixels)``, and round each *down* to a multiple
       of ``factor`` (at least ``factor``);
    3. else if it has fewer than ``min_pixels`` pixels, scale both input sides by
       ``beta = sqrt(min_pixels / (height*width))`` and round each *up* to a multiple of ``factor``.

    Args:
        height, width: input image size in pixels (positive ints). Note the order: **height
            first**, as in transformers.
        factor: both output sides are multiples of this (pixels).
        min_pixels, max_pixels: bounds on the output's pixel count.

    Returns:
        ``(resized_height, resized_width)`` in pixels, both multiples of ``factor``. With the
        defaults the pixel count always lies in ``[min_pixels, max_pixels]``; with other bounds
        the steps above are followed as is (e.g. step 2 may land below ``min_pixels`` when the
        bounds are close together).

    Raises:
        ConfigError (a ValueError): a size or bound that is not a positive int, ``min_pixels >
            max_pixels``, or an aspect ratio (long side / short side) above 200 — the Qwen2-VL
            image processor's own limit, which rejects such images.
    """
    height = _check_int(height, "height")
    width = _check_int(width, "width")
    factor = _check_int(factor, "factor")
    min_pixels = _check_int(min_pixels, "min_pixels")
    max_pixels = _check_int(max_pixels, "max_pixels")
    if min_pixels > max_pixels:
        raise ConfigError(
            f"min_pixels ({min_pixels}) must not exceed max_pixels ({max_pixels})"
        )
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ConfigError(
            f"height x width = {height} x {width}: aspect ratio {ratio:.6g} exceeds "
            f"{MAX_ASPECT_RATIO}, the limit of the Qwen2-VL image processor (smart_resize), "
            f"which rejects such images"
        )
    # No max(factor, .) here, as in transformers: a side below factor/2 rounds to 0, the product
    # is then 0 < min_pixels and the ceil branch rescales from the true input size.
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class ModelSpec:
    """What one vision encoder outputs per image: ``(N, embed_dim)`` elements of ``dtype``.

    Exactly one way of counting tokens must be given:

    * patch grid (Qwen2-VL family): ``patch_size``, ``merge_size``, ``temporal_patch_size``,
      ``min_pixels``, ``max_pixels`` — ``N`` follows :func:`smart_resize` with
      ``factor = patch_size * merge_size``;
    * fixed count: ``fixed_tokens`` — ``N`` is the same for every image.

    Attributes:
        name: canonical registry name, e.g. ``"qwen3-vl"``.
        embed_dim: width of the encoder output (its last dimension), in elements.
        dtype: element type as a torch dtype name without ``torch.``, e.g. ``"bfloat16"``.
        itemsize: bytes per element; derived from ``dtype`` when it is a known name
            (bfloat16/float16 2, float32 4, ...), and must agree with it if given.
        aliases: other names :func:`get_model` accepts (model types, Hugging Face repo ids).
        patch_size, merge_size, temporal_patch_size: ViT patch side (pixels), spatial merge
            (patches per token side) and frames per temporal patch.
        min_pixels, max_pixels: pixel-count bounds of the resize.
        fixed_tokens: tokens per image for fixed-count models.

    Raises:
        ConfigError: a missing, mixed, non-int or non-positive field, or ``itemsize`` that
            disagrees with a known ``dtype``.
    """

    name: str
    embed_dim: int
    dtype: str
    itemsize: Optional[int] = None
    aliases: Tuple[str, ...] = ()
    patch_size: Optional[int] = None
    merge_size: Optional[int] = None
    temporal_patch_size: Optional[int] = None
    min_pixels: Optional[int] = None
    max_pixels: Optional[int] = None
    fixed_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(f"ModelSpec.name must be a non-empty str, got {self.name!r}")
        if isinstance(self.aliases, str):
            raise ConfigError(
                f"ModelSpec.aliases must be a tuple of str, not a single str ({self.aliases!r})"
            )
        aliases = tuple(self.aliases)
        for alias in aliases:
            if not isinstance(alias, str) or not alias.strip():
                raise ConfigError(f"ModelSpec.aliases entries must be non-empty str, got {alias!r}")
        object.__setattr__(self, "aliases", aliases)
        _check_int(self.embed_dim, "ModelSpec.embed_dim")
        if not isinstance(self.dtype, str) or not self.dtype:
            raise ConfigError(f"ModelSpec.dtype must be a dtype name like 'bfloat16', got {self.dtype!r}")
        known = _DTYPE_ITEMSIZE.get(self.dtype)
        if self.itemsize is None:
            if known is None:
                raise ConfigError(
                    f"ModelSpec.itemsize is required for dtype {self.dtype!r} "
                    f"(known dtypes: {', '.join(sorted(_DTYPE_ITEMSIZE))})"
                )
            object.__setattr__(self, "itemsize", known)
        else:
            _check_int(self.itemsize, "ModelSpec.itemsize")
            if known is not None and self.itemsize != known:
                raise ConfigError(
                    f"ModelSpec.itemsize {self.itemsize} disagrees with dtype {self.dtype!r} "
                    f"({known} bytes)"
                )
        grid = {
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
        }
        given = [k for k, v in grid.items() if v is not None]
        if self.fixed_tokens is not None:
            _check_int(self.fixed_tokens, "ModelSpec.fixed_tokens")
            if given:
                raise ConfigError(
                    f"ModelSpec {self.name!r}: give either fixed_tokens or the patch-grid fields, "
                    f"not both (also got {', '.join(given)})"
                )
        else:
            missing = [k for k, v in grid.items() if v is None]
            if missing:
                raise ConfigError(
                    f"ModelSpec {self.name!r}: needs fixed_tokens or all patch-grid fields; "
                    f"missing {', '.join(missing)}"
                )
            for k, v in grid.items():
                _check_int(v, f"ModelSpec.{k}")
            if self.min_pixels > self.max_pixels:
                raise ConfigError(
                    f"ModelSpec.min_pixels ({self.min_pixels}) must not exceed "
                    f"ModelSpec.max_pixels ({self.max_pixels})"
                )

    @property
    def is_fixed(self) -> bool:
        """True for fixed-token models (every image gives ``fixed_tokens`` tokens)."""
        return self.fixed_tokens is not None

    @property
    def factor(self) -> Optional[int]:
        """Resize granularity in pixels, ``patch_size * merge_size`` (None for fixed models)."""
        if self.is_fixed:
            return None
        return self.patch_size * self.merge_size

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's row: ``embed_dim * itemsize``."""
        return self.embed_dim * self.itemsize

    @property
    def min_tokens(self) -> int:
        """Fewest tokens one image can give (tokens)."""
        if self.is_fixed:
            return self.fixed_tokens
        return -(-self.min_pixels // (self.factor * self.factor))

    @property
    def max_tokens(self) -> int:
        """Most tokens one image can give (tokens)."""
        if self.is_fixed:
            return self.fixed_tokens
        return self.max_pixels // (self.factor * self.factor)


QWEN3_VL = ModelSpec(
    name="qwen3-vl",
    aliases=(
        "qwen3_vl",
        "qwen3_vl_moe",
        "qwen3-vl-moe",
        "Qwen/Qwen3-VL-30B-A3B-Instruct",
    ),
    # Main merger (2048) + 3 deepstack mergers (2048 each), concatenated by vLLM.
    embed_dim=8192,
    dtype="bfloat16",
    itemsize=2,
    patch_size=16,
    merge_size=2,
    temporal_patch_size=2,
    min_pixels=65536,
    max_pixels=16777216,
)

GEMMA3 = ModelSpec(
    name="gemma3",
    aliases=("gemma-3", "google/gemma-3-27b-it"),
    embed_dim=5376,
    dtype="bfloat16",
    itemsize=2,
    fixed_tokens=256,
)

_lock = threading.Lock()
_models: dict = {}  # canonical name -> ModelSpec
_lookup: dict = {}  # casefolded name or alias -> canonical name

#: Read-only view of the registry: canonical name -> :class:`ModelSpec` (aliases not listed;
#: :func:`get_model` resolves them). Reflects later :func:`register_model` calls.
MODELS: Mapping[str, ModelSpec] = MappingProxyType(_models)


def _key(name: str) -> str:
    return name.strip().casefold()


def register_model(spec: ModelSpec, *, replace: bool = False) -> ModelSpec:
    """Add ``spec`` to the registry under its name and aliases (matched case-insensitively).

    Args:
        spec: the model to add.
        replace: allow replacing a registered model of the same canonical name (its old
            aliases are dropped). Without it, any clash of name or alias is an error.

    Returns:
        ``spec``.

    Raises:
        ConfigError: ``spec`` is not a ModelSpec, or its name or an alias is already taken by
            another model (or by the same name when ``replace`` is false).
    """
    if not isinstance(spec, ModelSpec):
        raise ConfigError(f"spec must be a ModelSpec, got {type(spec).__name__}")
    names = [spec.name, *spec.aliases]
    with _lock:
        old = _models.get(spec.name)
        if old is not None and not replace:
            raise ConfigError(
                f"spec.name {spec.name!r} is already registered (pass replace=True to replace it)"
            )
        for n in names:
            owner = _lookup.get(_key(n))
            if owner is not None and owner != spec.name:
                raise ConfigError(
                    f"spec: name or alias {n!r} already belongs to model {owner!r}"
                )
        if old is not None:
            for k in [k for k, v in _lookup.items() if v == spec.name]:
                del _lookup[k]
        _models[spec.name] = spec
        for n in names:
            _lookup[_key(n)] = spec.name
    return spec


register_model(QWEN3_VL)
register_model(GEMMA3)


def get_model(model: Union[str, ModelSpec] = DEFAULT_MODEL) -> ModelSpec:
    """Return the :class:`ModelSpec` registered as ``model`` (a name or alias, any case).

    A :class:`ModelSpec` is returned as is, so every function taking ``model=`` also accepts
    an unregistered spec.

    Raises:
        ConfigError (a ValueError): ``model`` is not a str/ModelSpec, or no model has that
            name or alias; the message lists the known names.
    """
    if isinstance(model, ModelSpec):
        return model
    if not isinstance(model, str):
        raise ConfigError(f"model must be a model name (str) or ModelSpec, got {type(model).__name__}")
    with _lock:
        canonical = _lookup.get(_key(model))
        if canonical is not None:
            return _models[canonical]
        known = []
        for spec in _models.values():
            known.append(spec.name)
            known.extend(spec.aliases)
    raise ConfigError(f"model {model!r} is not a known model; known: {', '.join(known)}")


@dataclass(frozen=True)
class ImageTokens:
    """How one image is encoded by one model, and what its encoder output weighs.

    Attributes:
        model: canonical model name.
        width, height: input image size in pixels.
        resized_width, resized_height: size after :func:`smart_resize`, in pixels
            (None for fixed-token models).
        grid_t, grid_h, grid_w: patch grid (frames/temporal patch, patches down, patches
            across); None for fixed-token models.
        num_patches: ``grid_t * grid_h * grid_w`` (None for fixed-token models).
        num_tokens: ``N``, vision tokens (rows of the encoder output).
        shape: ``(N, embed_dim)`` of the encoder output.
        dtype: element dtype name, e.g. ``"bfloat16"``.
        nbytes: ``N * embed_dim * itemsize``, bytes of the encoder output.
    """

    model: str
    width: int
    height: int
    resized_width: Optional[int]
    resized_height: Optional[int]
    grid_t: Optional[int]
    grid_h: Optional[int]
    grid_w: Optional[int]
    num_patches: Optional[int]
    num_tokens: int
    shape: Tuple[int, int]
    dtype: str
    nbytes: int


def image_tokens(width: int, height: int, model: Union[str, ModelSpec] = DEFAULT_MODEL) -> ImageTokens:
    """Tokens, shape and bytes of the encoder output for one still image.

    Args:
        width, height: input image size in pixels (positive ints). Note the order: **width
            first**, like ``"1920x1080"`` (unlike :func:`smart_resize`).
        model: model name/alias or :class:`ModelSpec` (default Qwen3-VL).

    Returns:
        :class:`ImageTokens`. For Qwen3-VL: 1920x1080 -> resized 1920x1088, grid 1x68x120,
        8160 patches, N = 2040, shape (2040, 8192) bfloat16, 33,423,360 bytes.

    Raises:
        ConfigError (a ValueError): unknown model, size not a positive int, or (patch-grid
            models) aspect ratio above 200 (the image processor's limit).
    """
    spec = get_model(model)
    width = _check_int(width, "width")
    height = _check_int(height, "height")
    if spec.is_fixed:
        n = spec.fixed_tokens
        return ImageTokens(
            model=spec.name,
            width=width,
            height=height,
            resized_width=None,
            resized_height=None,
            grid_t=None,
            grid_h=None,
            grid_w=None,
            num_patches=None,
            num_tokens=n,
            shape=(n, spec.embed_dim),
            dtype=spec.dtype,
            nbytes=n * spec.bytes_per_token,
        )
    rh, rw = smart_resize(
        height,
        width,
        factor=spec.factor,
        min_pixels=spec.min_pixels,
        max_pixels=spec.max_pixels,
    )
    # A still image is one frame repeated to temporal_patch_size frames: one temporal patch.
    grid_t = 1
    grid_h = rh // spec.patch_size
    grid_w = rw // spec.patch_size
    num_patches = grid_t * grid_h * grid_w
    n = num_patches // (spec.merge_size * spec.merge_size)
    return ImageTokens(
        model=spec.name,
        width=width,
        height=height,
        resized_width=rw,
        resized_height=rh,
        grid_t=grid_t,
        grid_h=grid_h,
        grid_w=grid_w,
        num_patches=num_patches,
        num_tokens=n,
        shape=(n, spec.embed_dim),
        dtype=spec.dtype,
        nbytes=n * spec.bytes_per_token,
    )


_SIZE_RE = re.compile(r"^\s*(\d+)\s*[xX×,]\s*(\d+)\s*$")


def parse_size(text: str) -> Tuple[int, int]:
    """Parse an image size written width first: ``"1920x1080"`` -> ``(1920, 1080)`` pixels.

    Accepts ``"WxH"`` (``x`` or ``X``), ``"W×H"`` (multiplication sign) and ``"W,H"``, with
    optional spaces around the numbers. Both must be positive decimal integers.

    Raises:
        ConfigError (a ValueError): ``text`` is not a str or not of that form; the message
            quotes the text.
    """
    if not isinstance(text, str):
        raise ConfigError(f"size text must be a str like '1920x1080', got {type(text).__name__}")
    m = _SIZE_RE.match(text)
    if m is None:
        raise ConfigError(
            f"size text {text!r} is not an image size; write WIDTHxHEIGHT in pixels, "
            f"e.g. '1920x1080', '1920×1080' or '1920,1080'"
        )
    w, h = int(m.group(1)), int(m.group(2))
    if w <= 0 or h <= 0:
        raise ConfigError(f"size text {text!r}: width and height must be positive")
    return w, h


def tokens_to_nbytes(num_tokens: int, model: Union[str, ModelSpec] = DEFAULT_MODEL) -> int:
    """Bytes of an encoder output of ``num_tokens`` tokens: ``num_tokens * embed_dim * itemsize``.

    Qwen3-VL: ``num_tokens * 8192 * 2`` (1024 tokens -> 16,777,216 bytes).

    Raises:
        ConfigError (a ValueError): ``num_tokens`` is not an int >= 0, or unknown model.
    """
    spec = get_model(model)
    num_tokens = _check_int(num_tokens, "num_tokens", minimum=0)
    return num_tokens * spec.bytes_per_token


def max_tokens(model: Union[str, ModelSpec] = DEFAULT_MODEL) -> int:
    """Most vision tokens one image can give (Qwen3-VL: 16384 = max_pixels / 32**2).

    Raises:
        ConfigError (a ValueError): unknown model.
    """
    return get_model(model).max_tokens


def min_tokens(model: Union[str, ModelSpec] = DEFAULT_MODEL) -> int:
    """Fewest vision tokens one image can give (Qwen3-VL: 64 = min_pixels / 32**2).

    Raises:
        ConfigError (a ValueError): unknown model.
    """
    return get_model(model).min_tokens
