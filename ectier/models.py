"""The model registry: what each vision encoder outputs per image, by model name or alias.

Pure Python (standard library only, no ``torch``), like :mod:`ectier.sizing`, whose token math
reads a :class:`ModelSpec` from here (this module imports nothing of the token math).

A model's encoder turns one image into ``(N, embed_dim)`` elements of one ``dtype``; ``N`` comes
from :func:`ectier.sizing.image_tokens` (fixed, or from the image's size in pixels).

Built-in models
    ``qwen3-vl`` (:data:`QWEN3_VL`, the default, reference Qwen3-VL-30B-A3B-Instruct): patch grid,
    patch 16 x merge 2 (32 pixels per token side), pixels in ``[65536, 16777216]``, output
    ``(N, 8192)`` bfloat16 — the main merger's 2048 columns plus three deepstack mergers' 2048
    each, concatenated by vLLM — from 64 tokens (1 MiB) to 16384 tokens (256 MiB) per image.
    ``gemma3`` (:data:`GEMMA3`, Gemma 3 27B): a fixed 256 tokens per image whatever its size,
    ``(256, 5376)`` bfloat16 = 2,752,512 bytes. The Qwen3-VL entry is the one docs/architecture.md
    describes (``(N, 8192)`` bfloat16, 1-256 MiB each); ``tests/test_sizing.py`` holds the
    worked examples.

Names and aliases are matched case-insensitively. Every error raised on purpose is an
:class:`ectier.errors.ConfigError` (a ``ValueError``) whose message names the argument at fault.
"""

from __future__ import annotations

import numbers
import threading
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional, Tuple, Union

from .entry import DTYPE_ITEMSIZE
from .errors import ConfigError

__all__ = [
    "DEFAULT_MODEL",
    "GEMMA3",
    "MODELS",
    "ModelSpec",
    "QWEN3_VL",
    "get_model",
    "register_model",
]

#: Name of the model assumed when none is given: Qwen3-VL (``(N, 8192)`` bfloat16).
DEFAULT_MODEL = "qwen3-vl"

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



@dataclass(frozen=True)
class ModelSpec:
    """What one vision encoder outputs per image: ``(N, embed_dim)`` elements of ``dtype``.

    Exactly one way of counting tokens must be given:

    * patch grid (Qwen2-VL family): ``patch_size``, ``merge_size``, ``temporal_patch_size``,
      ``min_pixels``, ``max_pixels`` — ``N`` follows :func:`~ectier.sizing.smart_resize` with
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

