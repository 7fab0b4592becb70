"""``ectier serve`` (run the cache daemon) and ``ectier stats`` (print a running daemon's stats).

The stats table shows a row only where some tier reports it (:data:`TIER_ROWS`): the remote
tier's rows (timeouts, back-off, ...) only with a remote tier, the host's write-behind rows
(clean / dirty evictions, write-behind writes) with a host tier.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any, Callable, Optional

import click
from rich.table import Table

from ..config import CacheConfig, format_bytes
from ..errors import ConfigError, EctierError
from .params import console as _console, not_empty
from ..config_sources import env_problems_alone, tiers_judged_after_env

__all__ = ["serve", "stats", "load_config", "TIER_ROWS", "tier_rows"]


def load_config(path: Optional[str]) -> CacheConfig:
    """``--config`` (if given) overlaid with ``ECTIER_*``; a bad value is a usage error naming
    the input at fault: ``--config``, or the variables (``ECTIER_CONFIG`` for the file it names)."""
    base = None
    # one context: ECTIER_NVME__PATH & co. may switch on a tier the file sets up, and the file's
    # tier sections are judged with the variables over them (a switch the file gives counts)
    with tiers_judged_after_env():
        if path is not None:
            try:
                base = CacheConfig.load(path)
            except ConfigError as exc:
                env_problems, env_vars = env_problems_alone()  # every bad input at once, the variables' too
                raise click.BadParameter(str(ConfigError(problems=[*exc.problems, *env_problems])),
                                         param_hint=", ".join(["--config", *env_vars])) from None
        try:
            return CacheConfig.from_env(base=base)
        except ConfigError as exc:
            hint = ", ".join(exc.env_vars) or ("--config" if path is not None else "ECTIER_* variables")
            raise click.BadParameter(str(exc), param_hint=hint) from None


# ========================================================================================= serve


@click.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True), default=None,
              help="YAML or JSON config (namespace, prefetch_threads; sections host, gpu, nvme, remote, daemon; "
                   "docs/operations.md); ECTIER_* variables override it. Given, it is used instead of the "
                   "file ECTIER_CONFIG names.")
@click.option("--socket", "socket_path", type=click.Path(readable=False), default=None, callback=not_empty,
              help="Unix socket to listen on (overrides daemon.socket_path).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
              default="info",
              show_default=True)
def serve(config_path: Optional[str], socket_path: Optional[str], log_level: str) -> None:
    """Run the cache daemon in the foreground (stop with SIGTERM, SIGHUP or Ctrl-C).

    It owns the host tier (an arena in daemon.shm_dir that clients map) and the NVMe tier, and
    serves engines over a Unix socket (msgpack; see docs/protocol.md).
    """
    import logging

    from ..daemon.server import run_daemon

    config = load_config(config_path)
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


def _used_capacity(t: dict[str, Any]) -> str:
    """The ``used / capacity`` cell; the remote tier's capacity is ``remote.max_entry_bytes`` (the
    largest entry written there), not the store's size, which is not known without I/O."""
    if "degraded" in t:
        return f"— (max entry {format_bytes(t['capacity_bytes'])})"
    return f"{format_bytes(t['used_bytes'])} / {format_bytes(t['capacity_bytes'])}"


def _count(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda t: str(t[key])


def _bytes_of(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda t: format_bytes(t[key])


#: the rows of the stats table: (label, the key a tier's stats must have for the row, its cell);
#: a row appears when some tier has its key, and a tier without it shows "—"
TIER_ROWS: tuple[tuple[str, str, Callable[[dict[str, Any]], str]], ...] = (
    ("used / capacity", "capacity_bytes", _used_capacity),
    ("entries", "entries", _count("entries")),
    ("hits", "hits", _count("hits")),
    ("hit bytes", "hit_bytes", _bytes_of("hit_bytes")),
    ("puts", "puts", _count("puts")),
    ("evictions", "evictions", _count("evictions")),
    ("clean evictions", "clean_evictions", _count("clean_evictions")),  # a copy below already: no write
    ("dirty evictions", "dirty_evictions", _count("dirty_evictions")),  # a write to NVMe tried inside the eviction
    ("drops (lost)", "drops", _count("drops")),  # evicted with no tier below taking them
    ("eviction write s", "eviction_write_s", lambda t: f"{t['eviction_write_s']:.3f}"),
    ("write-behind writes", "write_behind_writes", _count("write_behind_writes")),
    ("write-behind bytes", "write_behind_bytes", _bytes_of("write_behind_bytes")),
    ("write-behind failures", "write_behind_failures", _count("write_behind_failures")),
    ("misses", "misses", _count("misses")),  # the remote tier's
    ("errors", "errors", _count("errors")),  # the remote tier's (the NVMe tier's: the failure rows below)
    ("timeouts", "timeouts", _count("timeouts")),
    ("degraded (back-off)", "degraded", lambda t: "yes" if t["degraded"] else "no"),
    ("skipped in back-off", "skipped_degraded", _count("skipped_degraded")),
    ("skipped: node down", "skipped_node_down", _count("skipped_node_down")),
    ("demotions", "demotions", _count("demotions")),
    ("promotions", "promotions", _count("promotions")),
    ("checksum failures", "checksum_failures", _count("checksum_failures")),
    ("quarantined", "quarantined", _count("quarantined")),
    ("write failures", "write_failures", _count("write_failures")),
    ("read failures", "read_failures", _count("read_failures")),
)


def tier_rows(tiers: dict[str, dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """The stats table of ``tiers`` (``stats()["tiers"]``: tier name -> its stats): ``(label,
    [one cell per tier, in the order of tiers])`` for each row of :data:`TIER_ROWS` that some tier
    reports; a tier without the row's key gets ``"—"``."""
    rows = []
    for label, key, cell in TIER_ROWS:
        if any(key in t for t in tiers.values()):
            rows.append((label, [cell(t) if key in t else "—" for t in tiers.values()]))
    return rows


def _print_stats(data: dict[str, Any]) -> None:
    console = _console()
    lookups = data["hits"] + data["misses"]
    console.print(f"[bold]ectier daemon[/] {data['daemon']['socket']} — namespace {data['namespace']!r}, "
                  f"{data['entries']} entries, {data['hits']} hits / {data['misses']} misses"
                  + (f" ({data['hits'] / lookups:.1%} hit rate)" if lookups else ""))
    table = Table(title="tiers")
    table.add_column("")
    for name in data["tiers"]:
        table.add_column(name, justify="right")
    for label, cells in tier_rows(data["tiers"]):
        table.add_row(label, *cells)
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


def _finite(ctx: click.Context, param: click.Parameter, value: float) -> float:
    """A FloatRange lets NaN through (every comparison with it is false): refuse it by name."""
    if value != value:
        raise click.BadParameter(f"{value} is not a number of seconds")
    return value


@click.command()
@click.option("--socket", "socket_path", type=click.Path(readable=False), default=None, callback=not_empty,
              help="The daemon's socket (default: daemon.socket_path of ECTIER_* / the per-user default).")
@click.option("--json", "as_json", is_flag=True, help="Print the raw stats as JSON.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, max=3600, min_open=True), default=5.0,
              show_default=True, metavar="SECONDS", callback=_finite,
              help="Give up (exit code 1) when the daemon does not answer within this many seconds.")
def stats(socket_path: Optional[str], as_json: bool, timeout_s: float) -> None:
    """Print a running daemon's tiers, bytes, hits/misses/evictions and clients."""
    from ..daemon.client import DaemonClient

    if socket_path is None:
        socket_path = load_config(None).daemon.resolved_socket_path()
    try:
        with DaemonClient(socket_path, client_name="ectier-stats", timeout_s=timeout_s,
                          connect_retry_s=min(0.5, timeout_s)) as client:
            data = client.stats()
    except EctierError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True))
        return
    _print_stats(data)
