"""Request streams for the replay benchmarks: a realistic generator and CSV trace replay.

A stream is a list of :class:`Request` (``mm_hash``, ``num_tokens``, ``nbytes``, ``kind``); sizes
always come from :func:`ectier.sizing.image_tokens` (or the trace's token column).

Generator (:func:`generate`), deterministic for a seed:

- a catalogue of ``items`` images of four kinds, with realistic sizes:
  photos (0.3–12 MP, log-uniform, aspect 4:3 / 3:2 / 16:9 / 1:1 / 3:4), screenshots (1920x1080,
  2560x1440, 1366x768, 1170x2532 phone), documents (1700x2200 = US letter at 200 dpi, 1654x2339 =
  A4 at 200 dpi, 2550x3300 = letter at 300 dpi) and small images (256x256 .. 800x600: avatars,
  thumbnails, icons);
- popularity Zipf(``zipf_s``) over the catalogue (rank order independent of kind);
- **bursts**: with probability ``burst_p`` a request repeats the same image 2..``burst_max`` times
  in a row (the same picture posted by many users at once, retries);
- **multi-turn sessions**: with probability ``session_p`` a request continues an open chat
  session, which re-sends all its earlier images (vLLM sees them again at every turn) and, with
  probability ``session_new_p``, one new image.

Trace (:func:`read_trace`): CSV with a header, columns ``timestamp, mm_hash, width, height`` or
``timestamp, mm_hash, tokens``; rows are replayed in timestamp order (stable for ties).
"""

from __future__ import annotations

import csv
import hashlib
import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import ConfigError
from ..sizing import ModelSpec, get_model, image_tokens, tokens_to_nbytes
from .limits import MAX_ITEMS, check_stream

__all__ = ["Request", "WorkloadSpec", "generate", "read_trace", "stream_summary", "KIND_SIZES"]

#: Fixed sizes (W, H) per kind; photos are drawn from a megapixel range instead.
KIND_SIZES: dict[str, tuple[tuple[int, int], ...]] = {
    "screenshot": ((1920, 1080), (2560, 1440), (1366, 768), (1170, 2532)),
    "document": ((1700, 2200), (1654, 2339), (2550, 3300)),
    "small": ((256, 256), (384, 384), (512, 512), (640, 480), (800, 600)),
}
PHOTO_MP = (0.3, 12.0)
PHOTO_ASPECTS = (4 / 3, 3 / 2, 16 / 9, 1.0, 3 / 4)


@dataclass(frozen=True)
class Request:
    """One encoder-cache lookup.

    Fields: ``mm_hash`` (key), ``num_tokens`` (N), ``nbytes`` (N x embed_dim x itemsize, bytes),
    ``kind`` (photo / screenshot / document / small / trace), ``width``/``height`` (pixels, 0 if
    the trace gave tokens), ``timestamp`` (seconds, trace only; the index for generated streams).
    """

    mm_hash: str
    num_tokens: int
    nbytes: int
    kind: str
    width: int = 0
    height: int = 0
    timestamp: float = 0.0


@dataclass(frozen=True)
class WorkloadSpec:
    """Parameters of :func:`generate` (see the module docstring).

    Fields: ``requests`` (lookups, >= 1), ``items`` (catalogue size, >= 1), ``zipf_s`` (>= 0),
    ``mix`` (kind -> weight: photo, screenshot, document, small), ``burst_p``, ``burst_max``,
    ``session_p``, ``session_new_p`` (probabilities in [0, 1]), ``seed``, ``max_tokens`` (photos are
    capped to this many tokens; default the model's maximum).
    """

    requests: int = 300
    items: int = 150
    zipf_s: float = 0.9
    mix: tuple[tuple[str, float], ...] = (("photo", 0.35), ("screenshot", 0.25), ("document", 0.15), ("small", 0.25))
    burst_p: float = 0.05
    burst_max: int = 4
    session_p: float = 0.3
    session_new_p: float = 0.5
    seed: int = 0
    max_tokens: int | None = None

    def validate(self) -> None:
        """Raises ConfigError naming the bad field."""
        check_stream(self.requests, self.seed)
        if not 1 <= self.items <= MAX_ITEMS:
            raise ConfigError(f"items: must be in [1, {MAX_ITEMS:,}], got {self.items}")
        if not math.isfinite(self.zipf_s) or self.zipf_s < 0:
            raise ConfigError(f"zipf: must be a finite number >= 0, got {self.zipf_s}")
        for name in ("burst_p", "session_p", "session_new_p"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise ConfigError(f"{name}: must be in [0, 1], got {v}")
        kinds = {k for k, _ in self.mix}
        if not kinds <= {"photo", *KIND_SIZES} or sum(w for _, w in self.mix) <= 0:
            raise ConfigError(f"mix: kinds must be photo/screenshot/document/small with weights > 0, got {self.mix}")


def _key(seed: int, idx: int) -> str:
    return hashlib.sha256(f"ectier-bench:{seed}:{idx}".encode()).hexdigest()


def _photo_size(rng: np.random.Generator, max_tokens: int | None) -> tuple[int, int]:
    mp = math.exp(rng.uniform(math.log(PHOTO_MP[0]), math.log(PHOTO_MP[1])))
    if max_tokens is not None:
        mp = min(mp, max_tokens * 1024 / 1e6 * 0.95)
    aspect = PHOTO_ASPECTS[rng.integers(len(PHOTO_ASPECTS))]
    w = int(round(math.sqrt(mp * 1e6 * aspect)))
    return max(w, 32), max(int(round(w / aspect)), 32)


def generate(spec: WorkloadSpec, model: str | ModelSpec = "qwen3-vl") -> list[Request]:
    """Draw a request stream (see the module docstring); deterministic for ``spec.seed``.

    Returns ``spec.requests`` requests. Raises ConfigError on a bad spec.
    """
    spec.validate()
    m = get_model(model)
    rng = np.random.default_rng(spec.seed)
    kinds = [k for k, _ in spec.mix]
    weights = np.array([w for _, w in spec.mix], dtype=float)
    catalogue: list[Request] = []
    smallest = None  # tokens of the smallest image left out by max_tokens
    for i in range(spec.items):
        kind = kinds[rng.choice(len(kinds), p=weights / weights.sum())]
        if kind == "photo":
            w, h = _photo_size(rng, spec.max_tokens)
        else:
            sizes = KIND_SIZES[kind]
            w, h = sizes[rng.integers(len(sizes))]
        info = image_tokens(w, h, m)
        n = info.num_tokens
        if spec.max_tokens is not None and n > spec.max_tokens:
            smallest = n if smallest is None else min(smallest, n)
            continue  # a fixed-size kind above the cap: left out of the catalogue
        catalogue.append(Request(_key(spec.seed, i), n, info.nbytes, kind, w, h))
    if not catalogue:
        raise ConfigError(f"max_tokens: {spec.max_tokens} leaves no image in the catalogue; the smallest accepted "
                          f"value is {smallest}")
    order = rng.permutation(len(catalogue))
    pz = np.arange(1, len(catalogue) + 1, dtype=float) ** -spec.zipf_s
    pz /= pz.sum()

    def draw() -> Request:
        return catalogue[order[rng.choice(len(catalogue), p=pz)]]

    out: list[Request] = []
    sessions: list[list[Request]] = []
    while len(out) < spec.requests:
        u = rng.random()
        if sessions and u < spec.session_p:
            s = sessions[rng.integers(len(sessions))]
            batch = list(s)
            if rng.random() < spec.session_new_p:
                new = draw()
                s.append(new)
                batch.append(new)
            if len(s) >= 8:  # a long conversation ends
                sessions.remove(s)
        elif u < spec.session_p + spec.burst_p:
            batch = [draw()] * int(rng.integers(2, spec.burst_max + 1))
        else:
            first = draw()
            batch = [first]
            sessions.append([first])
            if len(sessions) > 16:
                sessions.pop(0)
        out.extend(batch)
    out = out[: spec.requests]
    return [Request(r.mm_hash, r.num_tokens, r.nbytes, r.kind, r.width, r.height, float(i)) for i, r in enumerate(out)]


def read_trace(path: str | os.PathLike, model: str | ModelSpec = "qwen3-vl") -> list[Request]:
    """Read a CSV trace: header ``timestamp,mm_hash,width,height`` or ``timestamp,mm_hash,tokens``.

    Rows are returned sorted by ``timestamp`` (seconds, float). ``width``/``height`` go through
    :func:`ectier.sizing.image_tokens`; ``tokens`` is taken as N directly.

    Raises:
        ConfigError: a missing file, text that is not UTF-8, missing columns, a bad value (message
            names the line and the column; a ``timestamp`` must be finite; ``tokens`` must lie in ``[1, model.max_tokens]``), or one ``mm_hash``
            with two different sizes.
    """
    m = get_model(model)
    try:
        f = open(path, newline="", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"trace: cannot open {os.fspath(path)!r}: {exc.strerror}") from None
    with f:
        try:
            return _read_rows(f, os.fspath(path), m)
        except UnicodeDecodeError as exc:
            raise ConfigError(f"trace: {os.fspath(path)} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def _column(row: dict, name: str, conv):
    """``conv(row[name])``; a ``ValueError`` naming the column for text that is not such a number
    (an empty cell included) and for a non-finite one (``nan``, ``inf``)."""
    text = row.get(name) or ""
    try:
        value = conv(text)
    except ValueError:
        kind = "an integer" if conv is int else "a number"
        raise ValueError(f"{name}: expected {kind}, got {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {text!r}")
    return value


def _read_rows(f, path: str, m: ModelSpec) -> list[Request]:
    """The rows of an open trace file (:func:`read_trace`), sorted by timestamp."""
    reader = csv.DictReader(f)
    cols = {c.strip() for c in reader.fieldnames or ()}
    has_wh, has_tok = {"width", "height"} <= cols, "tokens" in cols
    if not {"timestamp", "mm_hash"} <= cols or not (has_wh or has_tok):
        raise ConfigError(
            f"trace: need columns timestamp,mm_hash,width,height or timestamp,mm_hash,tokens; got {sorted(cols)}"
        )
    rows = []
    for lineno, raw in enumerate(reader, start=2):
        row = {k.strip(): (v or "").strip() for k, v in raw.items() if k is not None}
        try:
            ts = _column(row, "timestamp", float)
            key = row["mm_hash"]
            if not key:
                raise ValueError("empty mm_hash")
            if has_wh and row.get("width"):
                w, h = _column(row, "width", int), _column(row, "height", int)
                info = image_tokens(w, h, m)
                n, nbytes = info.num_tokens, info.nbytes
            else:
                w = h = 0
                n = _column(row, "tokens", int)
                if not 1 <= n <= m.max_tokens:
                    raise ValueError(f"tokens must be in [1, {m.max_tokens}] ({m.name}'s most per image), got {n}")
                nbytes = tokens_to_nbytes(n, m)
        except (ValueError, KeyError, ConfigError) as exc:
            raise ConfigError(f"trace: {path} line {lineno}: {exc}") from None
        rows.append(Request(key, n, nbytes, "trace", w, h, ts))
    if not rows:
        raise ConfigError(f"trace: {path} has no rows")
    seen: dict[str, int] = {}
    for r in rows:
        if seen.setdefault(r.mm_hash, r.num_tokens) != r.num_tokens:
            raise ConfigError(f"trace: mm_hash {r.mm_hash!r} appears with {seen[r.mm_hash]} and {r.num_tokens} tokens")
    rows.sort(key=lambda r: r.timestamp)
    return rows


def stream_summary(stream: Sequence[Request]) -> dict:
    """Requests, unique items, unique bytes (working set), requested bytes, and counts per kind."""
    unique: dict[str, Request] = {}
    kinds: dict[str, int] = {}
    for r in stream:
        unique.setdefault(r.mm_hash, r)
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    toks = sorted(r.num_tokens for r in unique.values())
    return {
        "requests": len(stream),
        "unique_items": len(unique),
        "unique_bytes": sum(r.nbytes for r in unique.values()),
        "requested_bytes": sum(r.nbytes for r in stream),
        "requests_by_kind": kinds,
        "tokens_min": toks[0] if toks else 0,
        "tokens_median": toks[len(toks) // 2] if toks else 0,
        "tokens_max": toks[-1] if toks else 0,
        "max_entry_bytes": max((r.nbytes for r in unique.values()), default=0),
    }
