"""Recompute cost of an encoder output: seconds to run the vision tower again for ``N`` tokens.

Two sources, never mixed within one report (every result carries :attr:`CostModel.source`):

- **fitted** (default without a GPU): ``t(N) = a + b*N + c*N**2`` fitted to the H200
  measurements (docs/benchmarks.md, "H200 reference figures") of the Qwen3-VL vision tower (27 blocks, random weights, transformers sdpa):
  19 ms at N=256 and 25 ms at N=1024. Two points identify two parameters, so the fit is
  **linear** (``c = 0``): ``b = (25 - 19) ms / 768 = 7.8125 us/token``, ``a = 19 ms - 256 b =
  17.0 ms`` (launch overhead, patch embedding and the mergers' fixed part dominate at these N).
  Attention is quadratic in the patch count (``4N``), so the linear fit *underestimates* the
  cost at large N; a crossover computed with it is therefore conservative (recomputation looks
  cheaper than it is, loading has to beat a lower bar).
- **measured**: a torch-only ViT of the documented shape (27 blocks, hidden 1152, 16 heads of 72,
  MLP 4304, patch 16, temporal patch 2, merge 2, a main merger plus three deepstack mergers after
  blocks 8, 16 and 24 -> output ``(N, 8192)``), random weights, timed on a device with
  ``torch.nn.functional.scaled_dot_product_attention`` at several N; ``a + b*N + c*N**2`` is then a
  least-squares fit of those timings. No ``transformers`` needed. On a CPU this takes seconds per
  forward pass, so it is only used when asked for (``--cost-model measured``) or on CUDA (``auto``).
- **scaled** (this machine, in seconds): the same tower cut to ``blocks`` blocks (default 1) and
  timed on this machine's CPU at a few small N; the timings give seconds per FLOP (least squares
  ``t = a + alpha * flops(N)``, ``a >= 0``), which :func:`tower_flop_terms` turns into the full
  27-block tower's ``b`` and ``c``. Matmuls and attention only (layer norms, GELU and copies are
  left out), and small-N efficiency is applied at every N, so it is an estimate of what running
  the real tower here would take - but it is *this* machine's, comparable with I/O measured here.
  ``ectier bench baseline`` uses it by default without CUDA, so that "vs recompute" compares like
  with like.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

__all__ = [
    "CostModel",
    "fitted_cost_model",
    "measured_cost_model",
    "resolve_cost_model",
    "scaled_cost_model",
    "tower_flop_terms",
    "VisionTower",
    "BACKGROUND_POINTS",
]

#: (N tokens, seconds) measured on one H200 (docs/benchmarks.md, "H200 reference figures").
BACKGROUND_POINTS: tuple[tuple[int, float], ...] = ((256, 0.019), (1024, 0.025))


@dataclass(frozen=True)
class CostModel:
    """``seconds(N) = a_s + b_s_per_token * N + c_s_per_token2 * N**2``.

    Fields:
        a_s: fixed seconds per encoder call.
        b_s_per_token: seconds per token.
        c_s_per_token2: seconds per token squared (attention); 0 for the fitted model.
        source: ``"fitted"``, ``"measured"`` or ``"scaled"``; the last two are on this machine
            (:attr:`on_this_machine`).
        description: what the report prints, e.g. ``"model fitted to the H200 figures of docs/benchmarks.md"``
            or ``"measured on cuda:0 (NVIDIA H200)"``.
        points: the ``(N, seconds)`` pairs it was fitted to.
    """

    a_s: float
    b_s_per_token: float
    c_s_per_token2: float
    source: str
    description: str
    points: tuple[tuple[int, float], ...] = field(default=())

    @property
    def on_this_machine(self) -> bool:
        """True when the seconds come from timings on the machine running the benchmark."""
        return self.source in ("measured", "scaled")

    def seconds(self, num_tokens: int) -> float:
        """Recompute seconds for an image of ``num_tokens`` tokens (>= 0). Raises ValueError if negative."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens: must be >= 0, got {num_tokens}")
        n = float(num_tokens)
        return max(0.0, self.a_s + self.b_s_per_token * n + self.c_s_per_token2 * n * n)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields plus the formula as text."""
        d = asdict(self)
        d["points"] = [list(p) for p in self.points]
        d["formula"] = (f"t(N) = {self.a_s * 1e3:.4g} ms + {self.b_s_per_token * 1e6:.4g} us * N"
                        f" + {self.c_s_per_token2 * 1e9:.4g} ns * N^2")
        return d


def fitted_cost_model() -> CostModel:
    """The linear model through the two H200 points (see the module docstring)."""
    (n0, t0), (n1, t1) = BACKGROUND_POINTS
    b = (t1 - t0) / (n1 - n0)
    a = t0 - b * n0
    return CostModel(a, b, 0.0, "fitted", "model fitted to the H200 figures of docs/benchmarks.md (linear, 2 points)",
                     BACKGROUND_POINTS)


# ================================================================================= measured


def _torch():
    import torch

    return torch


class VisionTower:
    """A Qwen3-VL-shaped vision tower with random weights, built from torch only (for timing).

    Shape (docs/architecture.md, "The tensor"; Qwen3-VL's vision config): patches of ``temporal 2 x 16 x 16 x 3`` pixels -> Linear(1536, 1152);
    ``depth`` pre-norm blocks (LayerNorm, qkv Linear(1152, 3456), SDPA over 16 heads of 72,
    Linear(1152, 1152), LayerNorm, MLP 1152 -> 4304 -> 1152 with GELU); a main merger and deepstack
    mergers after blocks 8, 16, 24 (each: LayerNorm, 2x2 patches -> Linear(4608, 4608), GELU,
    Linear(4608, 2048)); output ``(N, 2048 * (1 + deepstack taps))`` = ``(N, 8192)`` at depth 27.

    Args:
        device: torch device string (``"cpu"``, ``"cuda:0"``).
        dtype: torch dtype name; default bfloat16 on CUDA, float32 on CPU.
        depth: number of blocks (27; smaller only for tests).

    Raises:
        ImportError: torch is missing. RuntimeError: the device cannot hold the weights.
    """

    HIDDEN, HEADS, MLP, PATCH_IN, MERGE_IN, OUT = 1152, 16, 4304, 3 * 2 * 16 * 16, 4 * 1152, 2048
    DEEPSTACK = (8, 16, 24)

    def __init__(self, device: str = "cpu", *, dtype: str | None = None, depth: int = 27) -> None:
        torch = _torch()
        self.device = torch.device(device)
        if dtype is None:
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = getattr(torch, dtype)
        self.depth = depth
        gen = torch.Generator().manual_seed(0)
        h = self.HIDDEN

        def lin(i: int, o: int):
            w = torch.randn(o, i, generator=gen) / math.sqrt(i)
            return w.to(self.device, self.dtype), torch.zeros(o, device=self.device, dtype=self.dtype)

        self.patch = lin(self.PATCH_IN, h)
        self.blocks = [dict(qkv=lin(h, 3 * h), proj=lin(h, h), fc1=lin(h, self.MLP), fc2=lin(self.MLP, h))
                       for _ in range(depth)]
        taps = [d for d in self.DEEPSTACK if d <= depth]
        self.taps = taps
        self.mergers = [dict(fc1=lin(self.MERGE_IN, self.MERGE_IN), fc2=lin(self.MERGE_IN, self.OUT))
                        for _ in range(1 + len(taps))]

    def _merge(self, x, m):
        torch = _torch()
        F = torch.nn.functional
        x = F.layer_norm(x, (self.HIDDEN,)).reshape(-1, self.MERGE_IN)
        x = F.gelu(F.linear(x, *m["fc1"]))
        return F.linear(x, *m["fc2"])

    def forward(self, num_tokens: int):
        """Encoder output ``(num_tokens, 2048 * (1 + taps))`` for random pixels of ``4 * num_tokens`` patches."""
        torch = _torch()
        F = torch.nn.functional
        p = 4 * num_tokens
        h, heads = self.HIDDEN, self.HEADS
        with torch.inference_mode():
            x = torch.randn(p, self.PATCH_IN, device=self.device, dtype=self.dtype)
            x = F.linear(x, *self.patch)
            outs = []
            for i, blk in enumerate(self.blocks, start=1):
                y = F.layer_norm(x, (h,))
                q, k, v = F.linear(y, *blk["qkv"]).view(p, 3, heads, h // heads).permute(1, 2, 0, 3)
                a = F.scaled_dot_product_attention(q, k, v).permute(1, 0, 2).reshape(p, h)
                x = x + F.linear(a, *blk["proj"])
                y = F.layer_norm(x, (h,))
                x = x + F.linear(F.gelu(F.linear(y, *blk["fc1"])), *blk["fc2"])
                if i in self.taps:
                    outs.append(self._merge(x, self.mergers[1 + self.taps.index(i)]))
            return torch.cat([self._merge(x, self.mergers[0])] + outs, dim=1)

    def time_forward(self, num_tokens: int, *, repeats: int = 3, warmup: int = 1) -> float:
        """Median seconds of one forward pass at ``num_tokens`` tokens (device synchronized)."""
        torch = _torch()
        sync = (lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda" else (lambda: None)
        for _ in range(warmup):
            self.forward(num_tokens)
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.forward(num_tokens)
            sync()
            times.append(time.perf_counter() - t0)
        times.sort()
        return times[len(times) // 2]


def measured_cost_model(
    device: str | None = None, tokens: Sequence[int] = (64, 256, 1024, 4096), *, depth: int = 27, repeats: int = 3
) -> CostModel:
    """Time :class:`VisionTower` at each N in ``tokens`` on ``device`` and fit ``a + b*N + c*N**2``.

    Args:
        device: ``"cuda:<i>"`` or ``"cpu"``; default ``cuda:0`` when CUDA is available, else cpu.
        tokens: N values to time (>= 1 each; 3+ distinct values fit all three terms, 2 fit a line).
        depth: blocks (27 = the real tower; less only for tests, and then the description says so).
        repeats: timed passes per N (median taken).

    Raises:
        ValueError: fewer than 2 distinct ``tokens``. RuntimeError: from torch (e.g. out of memory).
    """
    import numpy as np

    torch = _torch()
    if device is None:
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    ns = sorted(set(int(n) for n in tokens))
    if len(ns) < 2 or ns[0] < 1:
        raise ValueError(f"tokens: need at least 2 distinct values >= 1, got {list(tokens)}")
    tower = VisionTower(device, depth=depth)
    pts = tuple((n, tower.time_forward(n, repeats=repeats)) for n in ns)
    deg = 2 if len(ns) >= 3 else 1
    coef = np.polyfit([float(n) for n, _ in pts], [t for _, t in pts], deg)
    c, b, a = (coef if deg == 2 else (0.0, *coef))
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "CPU"
    desc = f"measured on {device} ({name}), torch ViT depth {depth}, random weights"
    return CostModel(float(a), float(b), float(c), "measured", desc, pts)


def tower_flop_terms(depth: int = 27) -> tuple[float, float]:
    """FLOPs of :class:`VisionTower` of ``depth`` blocks as ``(per_token, per_token_squared)``:
    ``flops(N) = per_token * N + per_token_squared * N**2`` (matmuls: 2 FLOPs per multiply-add;
    attention over ``4N`` patches: ``QK^T`` and ``AV``, ``2 * (4N)**2 * hidden`` each per block;
    a main merger plus one per deepstack tap reached). Raises ValueError if ``depth < 0``."""
    if depth < 0:
        raise ValueError(f"depth: must be >= 0, got {depth}")
    t = VisionTower
    h, p = t.HIDDEN, 4  # 4 patches per token (merge 2x2)
    taps = sum(1 for d in t.DEEPSTACK if d <= depth)
    per_token = (2 * p * t.PATCH_IN * h + depth * 2 * p * (4 * h * h + 2 * h * t.MLP)
                 + (1 + taps) * 2 * (t.MERGE_IN * t.MERGE_IN + t.MERGE_IN * t.OUT))
    return float(per_token), float(depth * 4 * p * p * h)


def scaled_cost_model(
    tokens: Sequence[int] = (16, 32, 64), *, blocks: int = 1, repeats: int = 1, full_depth: int = 27
) -> CostModel:
    """Time a ``blocks``-block :class:`VisionTower` on this CPU, scale to ``full_depth`` by FLOPs.

    Takes a few seconds with the defaults (weights about 0.2 GB, float32). See the module docstring.
    A noisy timing (not growing with N, or other processes using most of the CPU meanwhile) is
    kept but said in the description: ``(NOISY: ...)``.

    Args:
        tokens: N values to time (>= 1 each, at least 2 distinct).
        blocks: blocks of the timed stack (>= 1; its one merger is timed too).
        repeats: timed passes per N (median taken; one warm-up pass before the first N).
        full_depth: blocks of the tower whose cost is modelled (27 = Qwen3-VL).

    Raises:
        ValueError: fewer than 2 distinct ``tokens``, or ``blocks`` < 1.
    """
    import numpy as np

    ns = sorted(set(int(n) for n in tokens))
    if len(ns) < 2 or ns[0] < 1:
        raise ValueError(f"tokens: need at least 2 distinct values >= 1, got {list(tokens)}")
    if blocks < 1:
        raise ValueError(f"blocks: must be >= 1, got {blocks}")
    from .noise import CpuProbe, NoiseThresholds

    tower = VisionTower("cpu", depth=blocks)
    probe = CpuProbe()
    probe.start()
    pts = tuple((n, tower.time_forward(n, repeats=repeats, warmup=1 if i == 0 else 0)) for i, n in enumerate(ns))
    other = probe.stop()
    lin, quad = tower_flop_terms(blocks)
    flops = np.array([lin * n + quad * n * n for n, _ in pts])
    secs = np.array([t for _, t in pts])
    alpha, a = np.polyfit(flops, secs, 1)
    if a < 0 or alpha <= 0:  # noise: fall back to a line through the origin
        a, alpha = 0.0, float(np.dot(flops, secs) / np.dot(flops, flops))
    full_lin, full_quad = tower_flop_terms(full_depth)
    desc = (f"{blocks} of {full_depth} ViT blocks timed on this machine's CPU at N={','.join(map(str, ns))} "
            f"({1e-9 / alpha:.1f} GFLOP/s), scaled to {full_depth} blocks by FLOPs")
    noise = []
    if any(t1 <= t0 for (_, t0), (_, t1) in zip(pts, pts[1:])):
        noise.append("timings do not grow with N")
    if other is not None and other > NoiseThresholds().max_other_cpu:
        noise.append(f"other processes used {other:.0%} of the CPU")
    if noise:
        desc += f" (NOISY: {'; '.join(noise)})"
    return CostModel(float(a), float(alpha * full_lin), float(alpha * full_quad), "scaled", desc, pts)


def resolve_cost_model(choice: str = "auto", *, cpu_fallback: str = "fitted", **measure_kw: Any) -> CostModel:
    """``"fitted"`` -> :func:`fitted_cost_model`; ``"measured"`` -> :func:`measured_cost_model`;
    ``"scaled"`` -> :func:`scaled_cost_model`; ``"auto"`` -> measured when CUDA is available, else
    ``cpu_fallback`` (``"fitted"``: measuring the whole tower on a CPU is slow; ``"scaled"``: this
    machine's seconds, for comparisons with I/O measured here).

    Raises:
        ValueError: an unknown ``choice`` or ``cpu_fallback``.
    """
    if cpu_fallback not in ("fitted", "scaled"):
        raise ValueError(f"cpu_fallback: expected fitted or scaled, got {cpu_fallback!r}")
    if choice == "fitted":
        return fitted_cost_model()
    if choice == "measured":
        return measured_cost_model(**measure_kw)
    if choice == "scaled":
        return scaled_cost_model(**measure_kw)
    if choice == "auto":
        torch = _torch()
        if torch.cuda.is_available():
            return measured_cost_model(**measure_kw)
        return fitted_cost_model() if cpu_fallback == "fitted" else scaled_cost_model(**measure_kw)
    raise ValueError(f"cost model: expected auto, fitted, measured or scaled, got {choice!r}")
