"""``ectier bench crossover``: per tier (host, NVMe, GPU with CUDA, remote when configured), the entry
size N at which loading stops beating recomputing, for the model's encoder cost.

::

    ectier bench crossover [--tiers-json DIR/tiers.json] [--remote-config ectier.yaml]
                           [--encoder-seconds-per-token 2e-5 | --cost-model auto|fitted|measured|scaled]

``--encoder-seconds-per-token`` is the connector's own rule (``ec_connector_extra_config.
encoder_seconds_per_token``: recompute = tokens x that, docs/vllm.md "Load or recompute"); without it
the recompute cost is the ``--cost-model``. The table gives, per tier, the encoder's seconds per token
at the largest measured N next to the load and recompute times there.
"""

from __future__ import annotations

import json
import os

import click

from ..errors import ConfigError
from .cli import _bytes, _common, _console, _cost, _machine, _noise_warning, _plot, _run_tiers, _tokens_list, \
    elapsed_s, print_written
from .report import fmt, markdown_table, print_table, write_json

__all__ = ["crossover_cmd", "per_token_cost"]


def per_token_cost(seconds_per_token: float):
    """The connector's linear recompute rule as a :class:`~ectier.bench.costmodel.CostModel`:
    ``seconds(N) = seconds_per_token * N``. Raises ValueError unless it is a finite number > 0."""
    import math

    from .costmodel import CostModel

    if not (isinstance(seconds_per_token, (int, float)) and math.isfinite(seconds_per_token) and seconds_per_token > 0):
        raise ValueError(f"expected a finite number of seconds > 0, got {seconds_per_token!r}")
    return CostModel(0.0, float(seconds_per_token), 0.0, "configured",
                     f"{seconds_per_token * 1e6:.3g} us per token (the connector's encoder_seconds_per_token rule)")


def _tiers_data(tiers_json, console, quiet, max_tokens, tokens, workdir, budget_bytes):
    if not tiers_json:
        return _run_tiers(console, quiet, min(max_tokens, 4096), tokens, True, workdir, budget_bytes)
    try:
        with open(tiers_json) as f:
            data = json.load(f)
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            raise ValueError("no 'rows' list")
    except (OSError, ValueError) as exc:
        raise click.BadParameter(f"not a `ectier bench tiers` result ({exc})", param_hint="--tiers-json") from None
    return data


def _remote_rows(remote_config, tokens, budget_bytes, console):
    """``(rows, why)``: the remote rows, or ``([], reason)`` when the store is unreachable (one
    line printed; the other tiers' rows are still written)."""
    from ..config import CacheConfig
    from .remote_rows import RemoteUnreachable, measure_remote
    from .tiers import DEFAULT_TOKENS

    try:
        cfg = CacheConfig.load(remote_config)
        return measure_remote(cfg, tokens or DEFAULT_TOKENS, budget_bytes=budget_bytes), None
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--remote-config") from None
    except RemoteUnreachable as exc:
        console.print(f"[yellow]remote rows not measured: {exc}[/yellow]")
        return [], str(exc)


@click.command("crossover")
@_common
@click.option("--tiers-json", type=click.Path(dir_okay=False, exists=True), default=None,
              help="reuse a `bench tiers` result instead of measuring")
@click.option("--max-tokens", default=16384, show_default=True, type=click.IntRange(64))
@click.option("--tokens", default=None, callback=_tokens_list,
              help="N list to measure, each 1..16384 (default 64,1024,4096 up to --max-tokens)")
@click.option("--budget-bytes", callback=_bytes, default="256MiB", show_default=True)
@click.option("--remote-config", type=click.Path(dir_okay=False, exists=True), default=None,
              help="an ectier config with a remote section: measure remote-tier reads too")
@click.option("--encoder-seconds-per-token", type=float, default=None,
              help="recompute = N x this (the connector's rule) instead of --cost-model")
def crossover_cmd(out, cost_model, workdir, quiet, tiers_json, max_tokens, tokens, budget_bytes, remote_config,
                  encoder_seconds_per_token) -> None:
    """Per tier, the entry size N at which loading stops beating recomputing."""
    from .crossover import crossover
    from .report import plot_crossover

    console = _console()
    if encoder_seconds_per_token is not None:
        try:
            cost = per_token_cost(encoder_seconds_per_token)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--encoder-seconds-per-token") from None
    else:
        cost = _cost(cost_model)
    data = _tiers_data(tiers_json, console, quiet, max_tokens, tokens, workdir, budget_bytes)
    rows_in = list(data["rows"])
    remote_why = None
    if remote_config:
        remote_rows, remote_why = _remote_rows(remote_config, tokens, budget_bytes, console)
        rows_in += remote_rows
    cross = crossover(rows_in, cost, max_tokens=max_tokens)
    headers = ["tier", "measured N", "load p50 ms at largest N", "recompute ms there", "encoder us/token there",
               "crossover"]
    rows = [[t, ",".join(str(p[0]) for p in d["points"]), fmt(d["points"][-1][1], "ms"), fmt(d["points"][-1][2], "ms"),
             f"{d['points'][-1][2] / d['points'][-1][0] * 1e6:.2f}", d["verdict"]] for t, d in cross.items()]
    if not remote_config:
        rows.append(["remote", "-", "-", "-", "-", "not measured (no --remote-config)"])
    elif remote_why:
        rows.append(["remote", "-", "-", "-", "-", "unreachable (see above)"])
    title = f"crossover (recompute: {cost.description}; load: measured on this machine, sync writes irrelevant)"
    print_table(console, title, headers, rows)
    warning = _noise_warning(console, data)
    result = {"command": "crossover", "machine": _machine(), "cost_model": cost.to_dict(), "tiers": cross,
              "skipped": data.get("skipped", []) + ([{"what": "remote rows", "reason": remote_why}] if remote_why else []),
              "noise": {**(data.get("noise") or {}), "warning": warning},
              "elapsed_s": elapsed_s()}
    write_json(result, os.path.join(out, "crossover.json"))
    with open(os.path.join(out, "crossover.md"), "w") as f:
        f.write(f"### crossover\n\n{title}\n\n" + markdown_table(headers, rows)
                + (f"\n**{warning}**\n" if warning else ""))
    grid = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
    written = ["crossover.json", "crossover.md"]
    png = os.path.join(out, "crossover.png")
    _plot(console, written, png, lambda: plot_crossover(cross, [(n, cost.seconds(n)) for n in grid if n <= max_tokens],
                                                        png, cost.source))
    print_written(console, out, written)
