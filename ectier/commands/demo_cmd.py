"""``ectier demo``: the main job, a Zipf-popular image stream replayed through a TieredCache
(:mod:`ectier.demo`; torch, lmdb and scikit-image are imported when it runs)."""

from __future__ import annotations

import os
from typing import Optional

import click

from ..bench.limits import MAX_REQUESTS
from ..errors import ConfigError, EctierError
from ..sizing import DEFAULT_MODEL, ModelSpec
from .params import ByteSize, ModelName, console as _console, sigterm_exits, zipf_exponent

__all__ = ["demo"]


@click.command()
@click.option("--requests", "-n", type=click.IntRange(min=1, max=MAX_REQUESTS), default=300, show_default=True,
              help="Requests in the replayed stream.")
@click.option("--zipf", "-s", type=click.FloatRange(min=0.0), default=1.1, show_default=True, callback=zipf_exponent,
              help="Popularity exponent: image at rank r is requested with probability ~ r**-s (0 = uniform).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seed of the request stream.")
@click.option("--host-bytes", type=ByteSize(), default=None,
              help="Host tier budget, e.g. 64MiB (default: 25% of the working set's unique bytes; 0 disables).")
@click.option("--nvme-bytes", type=ByteSize(), default=None,
              help="NVMe tier budget, e.g. 256MiB (default: 60% of the unique bytes; 0 disables).")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=None,
              help="An existing directory where the stores go (a fresh subdirectory, removed afterwards; "
                   "the directory itself is never created). Default: the temp dir.")
@click.option("--codec", type=click.Choice(["raw", "zstd", "zstd-planes"]), default="raw", show_default=True,
              help="NVMe tier codec.")
@click.option("--sync/--no-sync", default=False, show_default=True,
              help="fsync every NVMe commit (the safetensors baseline never fsyncs).")
@click.option("--model", "-m", type=ModelName(), default=DEFAULT_MODEL, show_default=True,
              help="Model whose encoder output is simulated (qwen3-vl: (N, 8192) bf16; gemma3: (256, 5376) bf16).")
@click.option("--images", type=click.IntRange(min=1), default=None,
              help="Use only the first N images of the working set (default: all).")
@click.option("--no-baseline", is_flag=True, help="Skip the safetensors-file-per-item baseline.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True, allow_dash=True), default=None,
              help="Also write the summary as JSON to this file ('-': standard output, the report then "
                   "going to standard error).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars or tables: one summary line.")
@click.pass_context
def demo(ctx: click.Context, requests: int, zipf: float, seed: int, host_bytes: Optional[int],
         nvme_bytes: Optional[int], directory: Optional[str], codec: str, sync: bool, model: ModelSpec,
         images: Optional[int], no_baseline: bool, json_path: Optional[str], quiet: bool) -> None:
    """The main job: replay a Zipf-popular image stream through a TieredCache (host -> NVMe).

    Real scikit-image photographs (plus 256x256, 1024x1024 and 1920x1080 resized photographs) go
    through a deterministic stand-in encoder; misses are encoded and put, hits are verified
    byte-exact against recomputation. Each request is also served by a safetensors file per item,
    as vLLM's ECExampleConnector stores it, for comparison. Exit code 1 if any hit mismatched.
    """
    from .. import demo as demo_mod  # torch, lmdb, scikit-image: only when needed

    if host_bytes == 0 and nvme_bytes == 0:
        raise click.UsageError("--host-bytes and --nvme-bytes are both 0: no tier could store anything", ctx=ctx)
    opts = demo_mod.DemoOptions(
        requests=requests, zipf=zipf, seed=seed, host_bytes=host_bytes, nvme_bytes=nvme_bytes,
        dir=directory, codec=codec, sync=sync, baseline=not no_baseline, model=model.name, images=images,
    )
    if json_path not in (None, "-"):
        _check_writable(json_path, ctx)
    console = _console(stderr=json_path == "-")
    try:
        with sigterm_exits():  # the run's stores are removed on SIGTERM too (as on Ctrl-C)
            summary = demo_mod.run_demo(opts, console=console, quiet=quiet)
    except ConfigError as exc:
        raise click.UsageError(_by_flag(str(exc)), ctx=ctx) from None
    except (EctierError, OSError) as exc:
        raise click.ClickException(f"demo failed: {exc}") from None
    _report(summary, console, quiet, err=json_path == "-")
    if json_path == "-":
        click.echo(demo_mod.summary_json(summary), nl=False)
    elif json_path is not None:
        try:
            demo_mod.write_json(summary, json_path)
        except OSError as exc:  # (the report above is printed already)
            raise click.ClickException(f"--json: cannot write {json_path}: {exc}") from None
    if not summary["ok"]:
        ctx.exit(1)


def _check_writable(path: str, ctx: click.Context) -> None:
    """Refuse ``--json path`` before the run unless the file can be opened for writing (it is
    created and removed again if it did not exist)."""
    existed = os.path.lexists(path)
    try:
        if not path or os.path.isdir(path):
            raise IsADirectoryError(f"{path or '(empty)'} is not a file name")
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
        if not existed:
            os.unlink(path)
    except OSError as exc:
        raise click.UsageError(f"--json: cannot write {path!r}: {exc.strerror or exc}", ctx=ctx) from None


def _report(summary: dict, console, quiet: bool, err: bool = False) -> None:
    """The run's report: one line with ``quiet`` (on standard error with ``err``), else the
    tables (:func:`ectier.demo.print_summary`)."""
    from .. import demo as demo_mod

    if quiet:
        ect = summary["ectier"]
        sp = summary["speedup"] or {}
        x = sp.get("load")
        load = "" if not x else (f", load {x:.1f}x faster than safetensors" if x >= 1
                                 else f", load {1 / x:.1f}x slower than safetensors")
        split = ""
        if summary["mismatches"]:  # which store disagreed with the recomputation tells a cache bug from an oracle bug
            base = summary["baseline"]
            split = f" (ectier {ect['mismatches']}, baseline {base['mismatches'] if base else '-'})"
        click.echo(
            f"{'OK' if summary['ok'] else 'FAIL'}: {ect['hits']}/{ect['requests']} hits "
            f"({ect['hit_rate']:.1%} items, {ect['byte_hit_rate']:.1%} bytes), "
            f"{summary['mismatches']} mismatches{split}{load}, {summary['wall_s']:.1f} s"
            + (" (synthetic pixels: scikit-image is not installed)" if summary["image_source"] == "synthetic" else ""),
            err=err,
        )
    else:
        demo_mod.print_summary(summary, console)


def _by_flag(text: str) -> str:
    """A config error's text with the demo's flag named before the knob it sets."""
    for flag, knob in (("--nvme-bytes", "nvme.capacity_bytes"), ("--host-bytes", "host.capacity_bytes")):
        if flag not in text:
            text = text.replace(knob, f"{flag} ({knob})")
    return text
