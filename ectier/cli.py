"""The ``ectier`` command line (console script ``ectier`` -> :func:`main`).

::

    ectier size 1920x1080 [1024x1024 ...] [--model qwen3-vl] [--json]   tokens, shape, bytes of images
    ectier models [--json]                                               registered models
    ectier demo [--requests 300 --zipf 1.1 --codec raw ...]              the main job (see ectier.demo)
    ectier bench tiers | replay | baseline | crossover                     benchmarks (see ectier.bench.cli)
    ectier fsck --path DIR [--repair] [--json]                           check / repair an NVMe store
    ectier --version

Bad arguments are usage errors (exit code 2, a message naming the argument, no traceback).
``size`` and ``models`` need only the token math; ``demo`` imports torch and the cache lazily.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Optional

import click
from rich.console import Console
from rich.table import Table

from . import __version__
from .config import CacheConfig, format_bytes, parse_bytes
from .errors import ConfigError, EctierError
from .sizing import DEFAULT_MODEL, MODELS, ImageTokens, ModelSpec, get_model, image_tokens, parse_size

__all__ = ["main"]


# =================================================================================== param types


class ImageSize(click.ParamType):
    """``WIDTHxHEIGHT`` in pixels (``1920x1080``, ``1920×1080``, ``1920,1080``) -> ``(w, h)``."""

    name = "WxH"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> tuple[int, int]:
        if isinstance(value, tuple):
            return value
        try:
            return parse_size(value)
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)


class ModelName(click.ParamType):
    """A registered model name or alias (any case) -> :class:`~ectier.sizing.ModelSpec`."""

    name = "MODEL"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> ModelSpec:
        if isinstance(value, ModelSpec):
            return value
        try:
            return get_model(value)
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)


class ByteSize(click.ParamType):
    """A byte count: ``1048576``, ``64MiB``, ``2GB`` (IEC = powers of 1024, SI = powers of 1000)."""

    name = "BYTES"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return parse_bytes(value, field_name=param.name if param is not None else "value")
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)


def _console() -> Console:
    return Console(highlight=False)


# ========================================================================================= group


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="ectier", message="%(prog)s %(version)s")
def main() -> None:
    """ectier: a tiered encoder cache (host memory -> NVMe/LMDB) for vision-language-model encoder
    outputs, keyed by vLLM's mm_hash."""


def _register_bench() -> None:
    from .bench.cli import bench  # click only at import; torch is imported when a bench command runs

    main.add_command(bench)


_register_bench()


# ========================================================================================== size


def _size_record(info: ImageTokens) -> dict[str, Any]:
    return {
        "model": info.model,
        "width": info.width,
        "height": info.height,
        "resized_width": info.resized_width,
        "resized_height": info.resized_height,
        "grid_t": info.grid_t,
        "grid_h": info.grid_h,
        "grid_w": info.grid_w,
        "num_patches": info.num_patches,
        "num_tokens": info.num_tokens,
        "shape": list(info.shape),
        "dtype": info.dtype,
        "nbytes": info.nbytes,
        "human": format_bytes(info.nbytes),
    }


@main.command()
@click.argument("sizes", nargs=-1, required=True, type=ImageSize())
@click.option("--model", "-m", type=ModelName(), default=DEFAULT_MODEL, show_default=True,
              help="Model name or alias (see `ectier models`).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list (one object per size) instead of a table.")
@click.pass_context
def size(ctx: click.Context, sizes: tuple[tuple[int, int], ...], model: ModelSpec, as_json: bool) -> None:
    """Vision tokens, encoder-output shape and bytes for images of SIZES (WIDTHxHEIGHT, pixels).

    \b
    Example: ectier size 1920x1080 1024x1024
      1920x1080 -> resized 1920x1088, grid 1x68x120, 8160 patches, N=2040,
      shape (2040, 8192) bfloat16, 33423360 bytes (31.9 MiB)
    """
    infos = []
    for w, h in sizes:
        try:
            infos.append(image_tokens(w, h, model))
        except ConfigError as exc:
            param = next(p for p in ctx.command.params if p.name == "sizes")
            raise click.BadParameter(f"{w}x{h}: {exc}", ctx=ctx, param=param) from None
    if as_json:
        click.echo(json.dumps([_size_record(i) for i in infos], indent=2))
        return
    console = _console()
    console.print(f"model {model.name}: encoder output (N, {model.embed_dim}) {model.dtype}")
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("", style="bold")
    for i in infos:
        table.add_column(f"{i.width}x{i.height}", justify="right")

    def row(label: str, fn) -> None:
        table.add_row(label, *(fn(i) for i in infos))

    row("model", lambda i: i.model)
    row("input WxH", lambda i: f"{i.width}x{i.height}")
    if not model.is_fixed:
        row("resized WxH", lambda i: f"{i.resized_width}x{i.resized_height}")
        row("grid t×h×w", lambda i: f"{i.grid_t}x{i.grid_h}x{i.grid_w}")
        row("patches", lambda i: str(i.num_patches))
    else:
        row("resized WxH", lambda i: f"(fixed {model.fixed_tokens} tokens)")
    row("tokens N", lambda i: str(i.num_tokens))
    row("shape", lambda i: f"({i.shape[0]}, {i.shape[1]})")
    row("dtype", lambda i: i.dtype)
    row("bytes", lambda i: str(i.nbytes))
    row("size", lambda i: format_bytes(i.nbytes))
    console.print(table)


# ======================================================================================== models


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def models(as_json: bool) -> None:
    """List the registered models: tokens per image, output width, dtype, bytes per image."""
    rows = []
    for spec in MODELS.values():
        rows.append({
            "name": spec.name,
            "aliases": list(spec.aliases),
            "tokens": "fixed" if spec.is_fixed else "patch-grid",
            "min_tokens": spec.min_tokens,
            "max_tokens": spec.max_tokens,
            "embed_dim": spec.embed_dim,
            "dtype": spec.dtype,
            "bytes_per_token": spec.bytes_per_token,
            "min_bytes": spec.min_tokens * spec.bytes_per_token,
            "max_bytes": spec.max_tokens * spec.bytes_per_token,
        })
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(show_edge=False, pad_edge=False)
    for col, just in (("name", "left"), ("tokens / image", "right"), ("width", "right"), ("dtype", "left"),
                      ("bytes / image", "right")):
        table.add_column(col, justify=just)
    for r in rows:
        tokens = (str(r["min_tokens"]) + " (fixed)" if r["tokens"] == "fixed"
                  else f"{r['min_tokens']}–{r['max_tokens']}")
        nbytes = (format_bytes(r["min_bytes"]) if r["min_bytes"] == r["max_bytes"]
                  else f"{format_bytes(r['min_bytes'])}–{format_bytes(r['max_bytes'])}")
        table.add_row(r["name"], tokens, str(r["embed_dim"]), r["dtype"], nbytes)
    console = _console()
    console.print("registered models (encoder output (N, width) of dtype; N tokens per image)")
    console.print(table)
    for r in rows:
        if r["aliases"]:
            console.print(f"{r['name']} aliases: {', '.join(r['aliases'])}", soft_wrap=True)


# ========================================================================================== demo


@main.command()
@click.option("--requests", "-n", type=click.IntRange(min=1), default=300, show_default=True,
              help="Requests in the replayed stream.")
@click.option("--zipf", "-s", type=click.FloatRange(min=0.0), default=1.1, show_default=True,
              help="Popularity exponent: image at rank r is requested with probability ~ r**-s (0 = uniform).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the request stream.")
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
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also write the summary as JSON to this file.")
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
    from . import demo as demo_mod  # torch, lmdb, scikit-image: only when needed

    if host_bytes == 0 and nvme_bytes == 0:
        raise click.UsageError("--host-bytes and --nvme-bytes are both 0: no tier could store anything", ctx=ctx)
    opts = demo_mod.DemoOptions(
        requests=requests, zipf=zipf, seed=seed, host_bytes=host_bytes, nvme_bytes=nvme_bytes,
        dir=directory, codec=codec, sync=sync, baseline=not no_baseline, model=model.name, images=images,
    )
    console = _console()
    try:
        summary = demo_mod.run_demo(opts, console=console, quiet=quiet)
    except ConfigError as exc:
        raise click.UsageError(str(exc), ctx=ctx) from None
    except (EctierError, OSError) as exc:
        raise click.ClickException(f"demo failed: {exc}") from None
    if json_path is not None:
        try:
            demo_mod.write_json(summary, json_path)
        except OSError as exc:
            raise click.ClickException(f"--json: cannot write {json_path}: {exc}") from None
    if quiet:
        ect = summary["ectier"]
        sp = summary["speedup"] or {}
        load = f", load {sp['load']:.1f}x vs safetensors" if sp.get("load") else ""
        split = ""
        if summary["mismatches"]:  # which store disagreed with the recomputation tells a cache bug from an oracle bug
            base = summary["baseline"]
            split = f" (ectier {ect['mismatches']}, baseline {base['mismatches'] if base else '-'})"
        click.echo(
            f"{'OK' if summary['ok'] else 'FAIL'}: {ect['hits']}/{ect['requests']} hits "
            f"({ect['hit_rate']:.1%} items, {ect['byte_hit_rate']:.1%} bytes), "
            f"{summary['mismatches']} mismatches{split}{load}, {summary['wall_s']:.1f} s"
            + (" (synthetic pixels: scikit-image is not installed)" if summary["image_source"] == "synthetic" else "")
        )
    else:
        demo_mod.print_summary(summary, console)
    if not summary["ok"]:
        ctx.exit(1)


# ========================================================================================= serve


def _load_config(path: Optional[str]) -> CacheConfig:
    """``--config`` (if given) overlaid with ``ECTIER_*``; a bad value is a usage error naming
    the input at fault: ``--config``, or the variables (``ECTIER_CONFIG`` for the file it names)."""
    base = None
    if path is not None:
        try:
            base = CacheConfig.load(path)
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--config") from None
    try:
        return CacheConfig.from_env(base=base)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint=", ".join(exc.env_vars) or "ECTIER_* variables") from None


@main.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True), default=None,
              help="YAML or JSON config (sections host, nvme, remote, daemon); ECTIER_* variables override it.")
@click.option("--socket", "socket_path", type=click.Path(), default=None,
              help="Unix socket to listen on (overrides daemon.socket_path).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
def serve(config_path: Optional[str], socket_path: Optional[str], log_level: str) -> None:
    """Run the cache daemon in the foreground (stop with SIGTERM or Ctrl-C).

    It owns the host tier (an arena in daemon.shm_dir that clients map) and the NVMe tier, and
    serves engines over a Unix socket (msgpack; see docs/protocol.md).
    """
    import dataclasses
    import logging

    from .daemon.server import run_daemon

    config = _load_config(config_path)
    if socket_path is not None:
        try:
            config = config.replace(daemon=dataclasses.replace(config.daemon, socket_path=socket_path))
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--socket") from None
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        rc = run_daemon(config)
    except EctierError as exc:
        raise click.ClickException(str(exc)) from None
    if "ectier.tiers.remote.mooncake" in sys.modules:  # a client left open: skip Mooncake's teardown
        sys.modules["ectier.tiers.remote.mooncake"].exit_now_if_abandoned(rc)
    sys.exit(rc)


# ========================================================================================= stats


@main.command()
@click.option("--socket", "socket_path", type=click.Path(), default=None,
              help="The daemon's socket (default: daemon.socket_path of ECTIER_* / the per-user default).")
@click.option("--json", "as_json", is_flag=True, help="Print the raw stats as JSON.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=5.0,
              show_default=True, metavar="SECONDS",
              help="Give up (exit code 1) when the daemon does not answer within this many seconds.")
def stats(socket_path: Optional[str], as_json: bool, timeout_s: float) -> None:
    """Print a running daemon's tiers, bytes, hits/misses/evictions and clients."""
    from .daemon.client import DaemonClient

    if socket_path is None:
        socket_path = _load_config(None).daemon.resolved_socket_path()
    try:
        with DaemonClient(socket_path, client_name="ectier-stats", timeout_s=timeout_s,
                          connect_retry_s=min(0.5, timeout_s)) as client:
            data = client.stats()
    except EctierError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    console = _console()
    lookups = data["hits"] + data["misses"]
    console.print(f"[bold]ectier daemon[/] {data['daemon']['socket']} — namespace {data['namespace']!r}, "
                  f"{data['entries']} entries, {data['hits']} hits / {data['misses']} misses"
                  + (f" ({data['hits'] / lookups:.1%} hit rate)" if lookups else ""))
    table = Table(title="tiers")
    table.add_column("")
    tiers = data["tiers"]
    for name in tiers:
        table.add_column(name, justify="right")
    rows = [("used / capacity", _used_capacity),
            ("entries", lambda t: str(t["entries"])), ("hits", lambda t: str(t["hits"])),
            ("hit bytes", lambda t: format_bytes(t["hit_bytes"])), ("puts", lambda t: str(t["puts"])),
            ("evictions", lambda t: str(t.get("evictions", "—"))),
            ("misses", lambda t: str(t.get("misses", "—"))),  # the remote tier's
            ("errors", lambda t: str(t["errors"]) if "timeouts" in t else "—"),  # the remote tier's, from here
            ("timeouts", lambda t: str(t.get("timeouts", "—"))),
            ("degraded (back-off)", lambda t: ("yes" if t["degraded"] else "no") if "degraded" in t else "—"),
            ("skipped in back-off", lambda t: str(t.get("skipped_degraded", "—"))),
            ("skipped: node down", lambda t: str(t.get("skipped_node_down", "—"))),
            ("demotions", lambda t: str(t.get("demotions", "—"))), ("promotions", lambda t: str(t.get("promotions", "—"))),
            ("checksum failures", lambda t: str(t.get("checksum_failures", "—")))]
    for label, fn in rows:
        table.add_row(label, *(fn(t) for t in tiers.values()))
    console.print(table)
    daemon = data["daemon"]
    clients = Table(title=f"clients ({len(daemon['clients'])}); open leases: put {daemon['leases']['put']}, "
                          f"get {daemon['leases']['get']}; expired {daemon['leases_expired']}")
    for col in ("id", "name", "pid", "uid", "connected", "requests", "leases"):
        clients.add_column(col, justify="right" if col not in ("name",) else "left")
    for c in daemon["clients"]:
        clients.add_row(str(c["id"]), c["name"], str(c["pid"]), str(c["uid"]), f"{c['connected_s']:.0f} s",
                        str(c["requests"]), str(c["leases"]))
    console.print(clients)
    views = daemon.get("views")
    if views is not None:  # a daemon with zero-copy views: the arena its clients pin under them
        console.print(f"view pins: {views['leases']} lease(s), {format_bytes(views['bytes'])} of the arena, "
                      f"{views['processes']} process(es); bounds {format_bytes(views['limit_bytes'])} per process"
                      f"{', ' + format_bytes(views['total_limit_bytes']) + ' in all' if 'total_limit_bytes' in views else ''}"
                      f"; granted {views['granted']}, refused {views['refused']}, released {views['released']}, "
                      f"released at exit {views['released_dead']}")


def _used_capacity(t: dict) -> str:
    """The ``used / capacity`` cell; the remote tier's capacity is ``remote.max_entry_bytes`` (the
    largest entry written there), not the store's size, which is not known without I/O."""
    if "degraded" in t:
        return f"— (max entry {format_bytes(t['capacity_bytes'])})"
    return f"{format_bytes(t['used_bytes'])} / {format_bytes(t['capacity_bytes'])}"


# ========================================================================================== fsck


class _CannotCheck(click.ClickException):
    exit_code = 2


@main.command()
@click.option("--path", "path", required=True, type=click.Path(file_okay=False),
              help="The store directory (the nvme.path of the cache or daemon).")
@click.option("--repair", "do_repair", is_flag=True,
              help="Rebuild a damaged store from its intact records; the damaged one is moved to DIR/damaged-<time>/.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def fsck(path: str, do_repair: bool, as_json: bool) -> None:
    """Check an NVMe store that no process has open: every record's header, payload and checksums.

    \b
    Exit code 0: healthy (or repaired by --repair); 1: damaged (a record fails
    its checks, or LMDB cannot read the store); 2: could not check (not a store,
    in use by another process, unreadable, repair failed).
    """
    from . import fsck as fsck_mod  # lmdb, torch: only when needed

    try:
        if do_repair:
            result = fsck_mod.repair(path)
            report = result.report
        else:
            result, report = None, fsck_mod.check(path)
    except EctierError as exc:
        raise _CannotCheck(str(exc)) from None
    except OSError as exc:
        raise _CannotCheck(f"--path: {exc}") from None
    if as_json:
        click.echo(json.dumps(result.to_dict() if result is not None else report.to_dict(), indent=2))
    else:
        _print_fsck(report, result)
    if report.damaged and (result is None or not result.repaired):
        sys.exit(1)


def _print_fsck(report: Any, result: Any) -> None:
    console = _console()
    state = "[bold red]damaged[/]" if report.damaged else "[bold green]healthy[/]"
    console.print(f"store {report.path}: {state} (read {'through LMDB' if report.mode == 'lmdb' else 'page by page: LMDB cannot read it'})",
                  soft_wrap=True)
    if report.lmdb_error:
        console.print(f"LMDB: {report.lmdb_error}", soft_wrap=True)
    table = Table(show_header=False, show_edge=False, pad_edge=False)
    table.add_column("")
    table.add_column("", justify="right")
    for label, value in (("entries", report.entries), ("intact", report.intact),
                         ("checksum-failed", report.checksum_failed), ("unreadable", report.unreadable),
                         ("orphan payloads", report.orphans), ("quarantined", report.quarantined)):
        table.add_row(label, str(value))
    if report.mode != "lmdb":
        table.add_row("damaged pages", str(report.damaged_pages))
    console.print(table)
    for p in report.problems[:10]:
        who = f"{p['namespace']}/{p['key']}" if p["key"] is not None else p["digest"][:16]
        console.print(f"  {who}: {p['problem']}", soft_wrap=True)
    if len(report.problems) > 10 or report.checksum_failed + report.unreadable > len(report.problems):
        console.print(f"  ... {report.checksum_failed + report.unreadable - min(10, len(report.problems))} more (--json lists up to {len(report.problems)})")
    if report.mode != "lmdb":
        console.print("(a page scan may also find records deleted shortly before the damage)")
    for d in report.damaged_copies:
        console.print(f"earlier damaged copy: {d} (delete it when done)", soft_wrap=True)
    if result is not None:
        if result.repaired:
            console.print(f"[bold]repaired[/]: {result.salvaged} records ({format_bytes(result.salvaged_bytes)}) in a fresh "
                          f"store, {result.lost} lost; the damaged store is in {result.moved_to} (delete it when done)",
                          soft_wrap=True)
        else:
            console.print("nothing to repair")
    elif report.damaged:
        console.print(f"repair: ectier fsck --path {report.path} --repair", soft_wrap=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
