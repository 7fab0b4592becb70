"""The ``ectier demo`` stand-in encoder: pixels -> a tensor of the real encoder's shape and dtype."""

from __future__ import annotations

import math

import numpy as np
import torch

from .errors import ConfigError
from .sizing import ModelSpec, get_model, image_tokens

__all__ = ["StandInEncoder"]


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

    @property
    def projection(self) -> torch.Tensor:
        """A copy of the projection matrix ``P`` of step 4: float32, ``(51, embed_dim)``, holding
        integers in ``-255..255`` (fixed by ``seed``)."""
        return self._proj.clone()

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
