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
       the same conditions (allocator state, page cache, other load on the machine). Each side
       loads as its connector does on the CPU — ectier a lease and a zero-copy view of the host
       arena (an NVMe hit decoded straight into the host slot it is promoted into), the baseline
       ``load_file`` (a lazy map of a page-cache file) — and then copies every loaded byte into
       one warm buffer (what vLLM's embedding gather does), inside the timed load.
    7. **Report.** Per-tier counters (from :meth:`TieredCache.stats`), hit rates by items and
       bytes, GB/s inside the cache calls, encoder time spent and saved, ectier vs baseline.

Entry points: :func:`run_demo` (returns the summary dict), :func:`print_summary` (rich tables),
:class:`DemoOptions`. The ``ectier demo`` command in :mod:`ectier.cli` wires them to options.
The parts live in their own modules and are re-exported here: :mod:`ectier.demo_workload`
(images, keys, stream), :mod:`ectier.demo_encoder` (the stand-in encoder),
:mod:`ectier.demo_baseline` (the safetensors store), :mod:`ectier.demo_replay` (the replay and
its verification) and :mod:`ectier.demo_report` (the report).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .cache import TieredCache
from .config import CacheConfig, HostTierConfig, NvmeTierConfig
from .demo_baseline import SafetensorsPerItemStore
from .demo_encoder import StandInEncoder
from .demo_replay import BaselineSide, EctierSide, Touch, by_size, replay, speedup
from .demo_report import print_summary
from .demo_workload import SEED_SIZES, SKIMAGE_PHOTOS  # noqa: F401  (re-exported)
from .demo_workload import DemoImage, load_images, mm_hash, zipf_stream
from .errors import ConfigError
from .tiers.storedir import free_bytes, probe_subdir
from .sizing import ImageTokens, ModelSpec, get_model, image_tokens

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

#: Share of the working set's unique bytes that the default budgets give each tier.
DEFAULT_HOST_FRACTION = 0.25
DEFAULT_NVME_FRACTION = 0.60
# What the NVMe tier must have beyond an entry's raw bytes to admit it (header allowance).
_NVME_HEADROOM_BYTES = 4096 + 2 * 65536


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


def _default_budgets(entry_bytes: list[int], opts: DemoOptions) -> tuple[int, int]:
    """``(host_bytes, nvme_bytes)``: ``opts``' budgets, or the defaults above for those left ``None``."""
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


def _check_room(opts: DemoOptions, nvme: int, baseline_bytes: int) -> None:
    """Refuse a run whose stores cannot fit where they go: the NVMe budget ``nvme``, plus
    ``baseline_bytes`` (each requested item once) for the safetensors baseline, which never evicts;
    it ran into a full disk with a traceback."""
    where = opts.dir or tempfile.gettempdir()
    free = free_bytes(where)
    if free is None:
        return
    if nvme > free:  # (the cache would name nvme.thin_provisioning, no demo option)
        raise ConfigError(f"nvme-bytes (--nvme-bytes): {nvme} bytes do not fit where the demo's stores go "
                          f"({where!r}: {free} bytes free); lower --nvme-bytes, or choose a --dir with room")
    if baseline_bytes and nvme + baseline_bytes > free:
        raise ConfigError(f"dir (--dir): the stores need {nvme + baseline_bytes} bytes ({nvme} for --nvme-bytes, "
                          f"{baseline_bytes} for the safetensors baseline, which keeps every requested item) but "
                          f"{where!r} has {free} bytes free; choose a --dir with room, lower --nvme-bytes, or "
                          "pass --no-baseline")


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


def _check_dir(path: Optional[str]) -> None:
    """Raise ConfigError unless ``path`` is ``None`` or an existing directory (never created) in
    which a subdirectory can be made (tried: made and removed again)."""
    if path is None:
        return
    if not os.path.isdir(path):
        # never create a directory the user named: a typo would leave a stray tree behind
        raise ConfigError(f"dir (--dir): {path!r} is not an existing directory; create it first "
                          "(the demo makes a fresh subdirectory inside it and removes that afterwards)")
    try:
        probe_subdir(path)
    except OSError as exc:
        raise ConfigError(f"dir (--dir): cannot make the run's subdirectory in {path!r}: {exc.strerror or exc}; "
                          "choose a writable directory") from None


def _notes(console: Console, quiet: bool) -> Callable[[str], None]:
    """A function printing ``note: <msg>`` on ``console``; one that prints nothing when ``quiet``."""
    if quiet:
        return lambda msg: None
    return lambda msg: console.print(f"[yellow]note:[/] {msg}", highlight=False)


def _safetensors_available(note: Callable[[str], None]) -> bool:
    """True if safetensors imports; otherwise notes that the baseline is skipped and returns False."""
    try:
        import safetensors.torch  # noqa: F401
    except ImportError as exc:
        note(f"safetensors is not installed ({exc}); baseline skipped (pip install 'ectier[demo]')")
        return False
    return True


def _cache_config(opts: DemoOptions, spec: ModelSpec, workdir: str, host_bytes: int, nvme_bytes: int) -> CacheConfig:
    """The demo's cache: host ``host_bytes``, NVMe ``nvme_bytes`` (0: no NVMe tier) under ``workdir``.

    Raises:
        ConfigError: a budget the tiers refuse, named by its flag (``--host-bytes``, ``--nvme-bytes``).
    """
    try:
        return _make_cache_config(opts, spec, workdir, host_bytes, nvme_bytes)
    except ConfigError as exc:
        text = str(exc).replace("host.capacity_bytes", "--host-bytes (host.capacity_bytes)")
        raise ConfigError(text.replace("nvme.capacity_bytes", "--nvme-bytes (nvme.capacity_bytes)")) from None


def _make_cache_config(opts: DemoOptions, spec: ModelSpec, workdir: str, host_bytes: int,
                       nvme_bytes: int) -> CacheConfig:
    return CacheConfig(
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


def _replay_in_workdir(
    opts: DemoOptions,
    spec: ModelSpec,
    encoder: StandInEncoder,
    images: list[DemoImage],
    stream: list[int],
    budgets: tuple[int, int],
    largest: int,
    with_baseline: bool,
    console: Console,
    quiet: bool,
) -> tuple[dict[str, Any], Optional[dict[str, Any]], float]:
    """Replay ``stream`` in a fresh subdirectory of ``opts.dir`` (removed afterwards).

    Returns ``(ectier, baseline, replay_s)``: the two sides' summaries (``ectier`` with the
    cache's ``stats`` and ``by_size``, :func:`~ectier.demo_replay.by_size`; ``baseline`` ``None``
    unless ``with_baseline``) and the replay's seconds. ``largest``: the largest entry's bytes.
    """
    host_bytes, nvme_bytes = budgets
    workdir = tempfile.mkdtemp(prefix="ectier-demo-", dir=opts.dir)
    try:
        config = _cache_config(opts, spec, workdir, host_bytes, nvme_bytes)
        with _progress(console, quiet) as progress, TieredCache(config) as cache:
            touch = Touch(largest)  # one warm destination both sides copy every loaded byte into
            ect_side = EctierSide(cache, touch)
            base_side = None
            if with_baseline:
                base_side = BaselineSide(SafetensorsPerItemStore(os.path.join(workdir, "safetensors")), touch)
            replay_s = replay(stream, images, encoder, ect_side, base_side, progress)
            ect = ect_side.summary(len(stream))
            ect["stats"] = cache.stats()
            base = base_side.summary(len(stream)) if base_side is not None else None
            ect["by_size"] = by_size(ect_side, base_side)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return ect, base, replay_s


def _image_rows(images: list[DemoImage], infos: list[ImageTokens], counts: np.ndarray) -> list[dict[str, Any]]:
    """One summary row per image: name, source, width, height, tokens, nbytes, mm_hash, requests."""
    return [
        {"name": img.name, "source": img.source, "width": img.width, "height": img.height,
         "tokens": tok.num_tokens, "nbytes": tok.nbytes, "mm_hash": img.mm_hash, "requests": int(c)}
        for img, tok, c in zip(images, infos, counts)
    ]


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
        ``ectier`` (counts, bytes, seconds, GB/s — GB = 1e9 bytes —, ``stats``, the cache's
        :meth:`~ectier.TieredCache.stats`, and ``by_size``, both sides' loads per entry size),
        ``baseline`` (or ``None``), ``speedup`` (baseline seconds per byte / ectier seconds per
        byte for ``load``, ``save`` and ``total``), ``replay_s`` (the replay loop) and ``wall_s``
        (everything, image loading included), all in seconds. A load's seconds include the
        consumer's copy of every loaded byte into a warm buffer, on both sides.

    Raises:
        ConfigError: an invalid option (the message names it), e.g. an unknown model or codec, or
            a ``dir`` that is not an existing directory.
        EctierError: the cache could not be opened in ``opts.dir``.
    """
    wall0 = time.perf_counter()
    _check_dir(opts.dir)
    console = console if console is not None else Console()
    note = _notes(console, quiet)
    spec = get_model(opts.model)
    encoder = StandInEncoder(spec, seed=opts.encoder_seed)
    images, origin = load_images(opts.images, warn=note)
    stream = zipf_stream(len(images), opts.requests, opts.zipf, opts.seed)
    infos = [image_tokens(img.width, img.height, spec) for img in images]
    entry_bytes = [tok.nbytes for tok in infos]
    host_bytes, nvme_bytes = _default_budgets(entry_bytes, opts)
    counts = np.bincount(np.asarray(stream), minlength=len(images))
    with_baseline = opts.baseline and _safetensors_available(note)
    baseline_bytes = sum(nb for nb, c in zip(entry_bytes, counts) if c) if with_baseline else 0
    _check_room(opts, nvme_bytes, baseline_bytes)
    ect, base, replay_s = _replay_in_workdir(opts, spec, encoder, images, stream, (host_bytes, nvme_bytes),
                                             max(entry_bytes), with_baseline, console, quiet)
    mismatches = ect["mismatches"] + (base["mismatches"] if base else 0)
    return {
        "ok": mismatches == 0,
        "mismatches": mismatches,
        "model": {"name": spec.name, "embed_dim": spec.embed_dim, "dtype": spec.dtype},
        "options": asdict(opts),
        "image_source": origin,
        "images": _image_rows(images, infos, counts),
        "unique_bytes": int(sum(entry_bytes)),
        "stream_unique_bytes": int(sum(nb for nb, c in zip(entry_bytes, counts) if c)),
        "budgets": {"host_bytes": host_bytes, "nvme_bytes": nvme_bytes, "codec": opts.codec,
                    "sync": opts.sync, "dir": opts.dir or tempfile.gettempdir()},
        "ectier": ect,
        "baseline": base,
        "speedup": speedup(ect, base),
        "replay_s": replay_s,
        "wall_s": time.perf_counter() - wall0,
    }


def summary_json(summary: dict[str, Any]) -> str:
    """``summary`` as indented JSON text, ending in a newline (what :func:`write_json` writes)."""
    return json.dumps(summary, indent=2, sort_keys=False) + "\n"


def write_json(summary: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``summary`` to ``path`` as indented JSON (``-`` is not special: it is a file name)."""
    Path(path).write_text(summary_json(summary), encoding="utf-8")
