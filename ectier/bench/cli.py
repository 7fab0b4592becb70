"""``ectier bench``: tiers | replay | baseline | crossover (:mod:`.crossover_cmd`) | connectors (:mod:`.connectors_cmd`). Results go to ``--out DIR`` as JSON,
markdown (``*.md``) and PNG plots; the main table is printed.

::

    ectier bench replay   [--requests 300 --policy lru,gdsf --host-bytes .. --nvme-bytes .. --trace t.csv] (:mod:`.replay_cmd`)
    ectier bench tiers    [--max-tokens 16384 --no-sync]
    ectier bench baseline [workload options as replay]
    ectier bench crossover [--tiers-json DIR/tiers.json | --max-tokens 16384] [--remote-config F]
                           [--encoder-seconds-per-token S]
    ectier bench connectors [--sizes 64,1024,2040,4096]
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..config import HostTierConfig, format_bytes, parse_bytes
from ..errors import ConfigError, EctierError
from ..commands.params import sigterm_exits, zipf_exponent
from ..sizing import max_tokens as _model_max_tokens
from .limits import MAX_ITEMS, MAX_REQUESTS
from .report import fmt, markdown_table, print_table, write_json

#: largest N one image gives (token math: Qwen3-VL smart_resize, max_pixels / 32**2 = 16384)
_MAX_TOKENS = _model_max_tokens()

__all__ = ["bench"]


def _bytes(ctx, param, value):
    if value is None:
        return None
    try:
        return parse_bytes(value, field_name=param.name)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None


def _progress(console: Console, quiet: bool) -> Progress:
    return Progress(TextColumn("[bold]{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, disable=quiet, transient=True)


def _console() -> Console:
    """A terminal's own width; ``COLUMNS`` when set; else 160 columns for piped output (logs)."""
    c = Console(highlight=False)
    if c.is_terminal or os.environ.get("COLUMNS", "").isdigit():
        return c
    return Console(highlight=False, width=160)


def _machine() -> dict[str, Any]:
    import torch

    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "cuda": torch.cuda.is_available(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def _cost(choice: str, cpu_fallback: str = "fitted"):
    from .costmodel import resolve_cost_model

    try:
        return resolve_cost_model(choice, cpu_fallback=cpu_fallback)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--cost-model") from None


def _stream(trace, requests, items, zipf, seed, max_tokens):
    from .workload import WorkloadSpec, generate, read_trace

    try:
        if trace:
            s = read_trace(trace)
            kept = s if max_tokens is None else [r for r in s if r.num_tokens <= max_tokens]
            if not kept:
                raise ConfigError(f"max_tokens: {max_tokens} leaves no image of the trace {trace!r}; the smallest "
                                  f"accepted value is {min(r.num_tokens for r in s)}")
            return kept, {"trace": trace}
        spec = WorkloadSpec(requests=requests, items=items, zipf_s=zipf, seed=seed, max_tokens=max_tokens)
        return generate(spec), {"generator": {k: getattr(spec, k) for k in spec.__dataclass_fields__}}
    except ConfigError as exc:
        if str(exc).startswith("max_tokens: "):  # refused before any run: the option at fault, by its name
            raise click.BadParameter(str(exc).removeprefix("max_tokens: "), param_hint="--max-tokens") from None
        raise click.UsageError(str(exc)) from None


def resolve_budgets(summ: dict, host_bytes: int | None, nvme_bytes: int | None) -> tuple[int, int]:
    """``(host, nvme)`` budgets in bytes: the options', or the defaults for the stream summary
    ``summ`` (``replay.default_budgets``) where left unset; both 0 is a usage error."""
    from .replay import default_budgets

    dh, dn = default_budgets(summ["unique_bytes"])
    host_bytes = dh if host_bytes is None else host_bytes
    nvme_bytes = dn if nvme_bytes is None else nvme_bytes
    if host_bytes == 0 and nvme_bytes == 0:
        raise click.UsageError("--host-bytes and --nvme-bytes are both 0: no tier could store anything")
    from ..tiers.nvme_segment import check_capacity

    # the checks a cache of these budgets would make (a 1-byte tier ran silently)
    checks = (("--host-bytes", "host.capacity_bytes", lambda: HostTierConfig(capacity_bytes=host_bytes)),
              ("--nvme-bytes", "nvme.capacity_bytes", lambda: check_capacity(nvme_bytes)))
    for option, knob, check in checks:
        try:
            check()
        except ConfigError as exc:
            raise click.BadParameter(str(exc).removeprefix(f"{knob}: "), param_hint=option) from None
    return host_bytes, nvme_bytes


def _out_dir(ctx, param, value):
    """Create the results directory up front, so a bad --out fails before the run, not after."""
    try:
        os.makedirs(value, exist_ok=True)
    except OSError as exc:
        raise click.BadParameter(f"cannot create {value!r}: {exc.strerror}") from None
    if not os.access(value, os.W_OK):
        raise click.BadParameter(f"{value!r} is not writable")
    return value


def _workdir(ctx, param, value):
    """Refuse a --workdir in which no subdirectory can be made (tried: made and removed), before
    the run; a path check alone lets /proc through for root."""
    if value is not None:
        from ..tiers.storedir import probe_subdir

        try:
            probe_subdir(value)
        except OSError as exc:
            raise click.BadParameter(f"cannot make a store directory in {value!r}: {exc.strerror or exc}") from None
    return value


def workdir_option(help_text: str):
    """The ``--workdir DIR`` option of a bench command: an existing directory in which a
    subdirectory can be made (checked before the run)."""
    return click.option("--workdir", default=None, type=click.Path(file_okay=False, exists=True, writable=True),
                        callback=_workdir, help=help_text)


def _plot(console: Console, written: list[str], path: str, draw) -> None:
    """Run ``draw()`` (which writes the PNG at ``path``) after the JSON and markdown are on disk;
    without matplotlib print one note line instead, so the command still exits 0 with its results."""
    from .report import try_plot

    reason = try_plot(draw)
    if reason is None:
        written.append(os.path.basename(path))
    else:
        console.print(f"note: {reason}", soft_wrap=True, highlight=False, markup=False)


def _common(f):
    f = click.option("--out", "out", default="bench-results", show_default=True, type=click.Path(file_okay=False),
                     callback=_out_dir, help="directory for JSON, markdown and PNG results")(f)
    f = click.option("--cost-model", default="auto", show_default=True,
                     type=click.Choice(["auto", "fitted", "measured", "scaled"]),
                     help="recompute cost: auto = measured with CUDA, else fitted to H200 figures (docs/benchmarks.md) "
                          "(baseline: else scaled, i.e. timed on this CPU); scaled = 1 ViT block timed here, "
                          "scaled to 27")(f)
    f = workdir_option("existing directory where temporary NVMe stores go (default: system temp dir)")(f)
    f = click.option("--quiet", "-q", is_flag=True, help="no progress bars")(f)
    return f


def _workload(f):
    f = click.option("--trace", type=click.Path(dir_okay=False, exists=True), default=None,
                     help="CSV: timestamp,mm_hash,width,height or timestamp,mm_hash,tokens")(f)
    f = click.option("--requests", default=300, show_default=True, type=click.IntRange(1, MAX_REQUESTS),
                     help="requests in the generated stream (ignored with --trace)")(f)
    f = click.option("--items", default=150, show_default=True, type=click.IntRange(1, MAX_ITEMS),
                     help="catalogue size (images drawn one by one: ~50 s at the most)")(f)
    f = click.option("--zipf", default=0.9, show_default=True, type=float, callback=zipf_exponent,
                     help="Zipf exponent s of item popularity")(f)
    f = click.option("--seed", default=0, show_default=True, type=click.IntRange(0),
                     help="seed of the generated stream (the same seed: the same requests)")(f)
    f = click.option("--max-tokens", default=None, type=click.IntRange(64), help="cap on N per image")(f)
    return f


#: ``click.Context.meta`` key: when the running bench command started (``time.perf_counter()``)
_STARTED = "ectier.bench.started"


def elapsed_s() -> float:
    """Seconds since the running bench command started (its group's invoke, so the imports of
    torch and the cache count); outside a bench command, 0."""
    ctx = click.get_current_context(silent=True)
    started = ctx.meta.get(_STARTED) if ctx is not None else None
    return time.perf_counter() - started if started is not None else 0.0


def print_written(console: Console, out: str, written: list[str]) -> None:
    """The last line of a bench command: the files it wrote under ``out`` and the seconds the whole
    command took (plots included)."""
    console.print(f"wrote {out}/{', '.join(written)} in {elapsed_s():.1f} s")


class _BenchGroup(click.Group):
    """Runs a bench command with SIGTERM turned into a normal exit (so temporary stores are removed)
    and ectier's own errors (e.g. budgets no tier can use) reported as clean CLI errors."""

    #: commands in modules of their own (they import this module's helpers): loaded when named
    LAZY = {"replay": ("ectier.bench.replay_cmd", "replay_cmd"),
            "crossover": ("ectier.bench.crossover_cmd", "crossover_cmd"),
            "connectors": ("ectier.bench.connectors_cmd", "connectors_cmd")}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.LAZY))

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.LAZY and name not in self.commands:
            import importlib

            module, attr = self.LAZY[name]
            self.add_command(getattr(importlib.import_module(module), attr))
        return super().get_command(ctx, name)

    def invoke(self, ctx: click.Context) -> Any:
        ctx.meta[_STARTED] = time.perf_counter()  # before the command's lazy imports (torch: seconds)
        try:
            with sigterm_exits():  # the temporary stores are removed on SIGTERM too
                return super().invoke(ctx)
        except EctierError as exc:
            raise click.ClickException(str(exc)) from None


@click.group("bench", cls=_BenchGroup)
def bench() -> None:
    """Benchmarks: per-tier throughput, trace replay (LRU vs GDSF), baselines, load-vs-recompute crossover."""


# ================================================================================== baseline


@bench.command("baseline")
@_common
@_workload
@click.option("--host-bytes", callback=_bytes, default=None, help="ectier host budget (default as replay)")
@click.option("--nvme-bytes", callback=_bytes, default=None, help="ectier NVMe budget (default as replay)")
def baseline_cmd(out, cost_model, workdir, quiet, trace, requests, items, zipf, seed, max_tokens, host_bytes,
                 nvme_bytes) -> None:
    """The same stream through the safetensors-per-item store, recomputation, and ectier (LRU, GDSF).

    Encoder seconds come from this machine by default (CUDA: the measured tower; else one block timed
    on the CPU and scaled), like the cache I/O; the output says whether the comparison is like with like."""
    from .baseline import baseline_rows, compare_stores, recompute_only, replay_safetensors
    from .replay import replay_stream
    from .report import plot_baseline
    from .workload import stream_summary

    console = _console()
    cost = _cost(cost_model, cpu_fallback="scaled")  # like with like: this machine's encoder seconds
    stream, source = _stream(trace, requests, items, zipf, seed, max_tokens)
    summ = stream_summary(stream)
    host_bytes, nvme_bytes = resolve_budgets(summ, host_bytes, nvme_bytes)
    rows_out = [recompute_only(stream, cost)]
    with _progress(console, quiet) as prog:
        t = prog.add_task("safetensors per item", total=len(stream))
        rows_out.append(replay_safetensors(stream, cost, workdir=workdir, advance=lambda k: prog.advance(t, k)))
        for p in ("lru", "gdsf"):
            t = prog.add_task(f"ectier {p}", total=len(stream))
            rows_out.append(replay_stream(stream, cost, policy=p, host_bytes=host_bytes, nvme_bytes=nvme_bytes,
                                          workdir=workdir, advance=lambda k, t=t: prog.advance(t, k)))
    comparison = compare_stores(rows_out, cost)
    headers, rows = baseline_rows(rows_out)
    title = (f"baseline: {summ['requests']} requests, working set {format_bytes(summ['unique_bytes'])}; "
             f"encoder seconds from {cost.description}; cache I/O measured on this machine")
    print_table(console, title, headers, rows)
    console.print(comparison["text"], style=None if comparison["like_with_like"] else "yellow", markup=False)
    result = {"command": "baseline", "machine": _machine(), "cost_model": cost.to_dict(), "comparison": comparison,
              "workload": {**source, **summ}, "stores": rows_out, "elapsed_s": elapsed_s()}
    os.makedirs(out, exist_ok=True)
    write_json(result, os.path.join(out, "baseline.json"))
    with open(os.path.join(out, "baseline.md"), "w") as f:
        f.write(f"### baseline\n\n{title}\n\n" + markdown_table(headers, rows) + f"\n{comparison['text']}\n")
    written = ["baseline.json", "baseline.md"]
    png = os.path.join(out, "baseline.png")
    _plot(console, written, png, lambda: plot_baseline(rows_out, png, comparison))
    print_written(console, out, written)


# ===================================================================================== tiers


def _noise_cell(r: dict[str, Any]) -> str:
    if "noise" not in r:  # a tiers.json from before noise detection
        return "?"
    tries = f" ({r['attempts']} tries)" if r["attempts"] > 1 else ""
    return ("NOISY" if r["noisy"] else "ok") + tries


def _tiers_rows(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["tier", "op", "impl", "N", "entry", "GB/s", "p50 ms", "p99 ms", "reps", "noise"]
    rows = [[r["tier"], r["op"], r["impl"], str(r["num_tokens"]), format_bytes(r["nbytes"]), fmt(r["gbps"], "gbps"),
             fmt(r["p50_s"], "ms"), fmt(r["p99_s"], "ms"), str(r["reps"]), _noise_cell(r)] for r in data["rows"]]
    return headers, rows


def _noise_warning(console: Console, data: dict[str, Any]) -> str | None:
    """Print (yellow) and return the noisy-run line of a tiers result, if any."""
    from .noise import noise_summary

    text = noise_summary(data["rows"], (data.get("noise") or {}).get("other_cpu"))
    if text:
        console.print(text, style="yellow", markup=False, highlight=False)
    return text


def _tokens_list(ctx, param, value):
    """click callback: "64,1024" -> (64, 1024); each N in 1..MAX_TOKENS (sizing's largest image)."""
    if value is None:
        return None
    parts = [p.strip() for p in str(value).split(",")]
    try:
        ns = tuple(int(p) for p in parts)
    except ValueError:
        raise click.BadParameter(f"expected comma-separated whole numbers of tokens, e.g. 64,1024,4096; got {value!r}")
    bad = [n for n in ns if not 1 <= n <= _MAX_TOKENS]
    if bad:
        raise click.BadParameter(f"each N must be in 1..{_MAX_TOKENS} (visual tokens per image); got {bad[0]}")
    return tuple(sorted(set(ns)))


def _run_tiers(console, quiet, max_tokens, tokens, sync, workdir, budget, retries=2):
    from .tiers import DEFAULT_TOKENS, FULL_TOKENS, measure_tiers

    if tokens:
        ns = tokens
    else:
        ns = tuple(n for n in (FULL_TOKENS if max_tokens and max_tokens > 4096 else DEFAULT_TOKENS)
                   if n <= (max_tokens or 4096))
    with _progress(console, quiet) as prog:
        t = prog.add_task("tiers", total=2 * len(ns))
        return measure_tiers(ns, sync=sync, workdir=workdir, budget_bytes=budget, retries=retries,
                             advance=lambda k: prog.advance(t, k))


@bench.command("tiers")
@click.option("--out", default="bench-results", show_default=True, type=click.Path(file_okay=False), callback=_out_dir,
              help="directory for JSON, markdown and PNG results")
@workdir_option("existing directory on the disk to measure")
@click.option("--quiet", "-q", is_flag=True, help="no progress bars")
@click.option("--max-tokens", default=None, type=click.IntRange(64), help="16384 for the full range (64..16384)")
@click.option("--tokens", default=None, callback=_tokens_list,
              help="explicit comma-separated N list, each 1..16384 (overrides --max-tokens)")
@click.option("--sync/--no-sync", default=True, show_default=True, help="fsync NVMe writes (LMDB and raw)")
@click.option("--budget-bytes", callback=_bytes, default="512MiB", show_default=True,
              help="about how many bytes each measurement moves")
@click.option("--retries", default=2, show_default=True, type=click.IntRange(0),
              help="repeat a noisy measurement (spread, disturbed median, other load) up to this many times")
def tiers_cmd(out, workdir, quiet, max_tokens, tokens, sync, budget_bytes, retries) -> None:
    """put/get GB/s and p50/p99 per tier vs its physical reference (memcpy, raw file I/O, O_DIRECT, pinned copies).

    Noisy measurements are repeated, and what stays noisy is flagged in the table, the JSON and one warning line."""
    from .report import plot_tiers

    console = _console()
    data = _run_tiers(console, quiet, max_tokens, tokens, sync, workdir, budget_bytes, retries)
    headers, rows = _tiers_rows(data)
    print_table(console, f"tiers (sync={sync})", headers, rows)
    for s in data["skipped"]:
        console.print(f"skipped {s['what']}: {s['reason']}")
    warning = _noise_warning(console, data)
    data["noise"]["warning"] = warning
    data.update(command="tiers", machine=_machine(), elapsed_s=elapsed_s())
    os.makedirs(out, exist_ok=True)
    write_json(data, os.path.join(out, "tiers.json"))
    with open(os.path.join(out, "tiers.md"), "w") as f:
        f.write("### tiers\n\n" + markdown_table(headers, rows)
                + "".join(f"\nskipped {s['what']}: {s['reason']}\n" for s in data["skipped"])
                + (f"\n**{warning}**\n" if warning else ""))
    written = ["tiers.json", "tiers.md"]
    png = os.path.join(out, "tiers.png")
    _plot(console, written, png, lambda: plot_tiers(data["rows"], png))
    print_written(console, out, written)
