"""``ectier bench connectors``: vLLM's EC connectors and ECTierConnector through vLLM's own calls.

::

    ectier bench connectors [--sizes 64,1024,2040,4096 --variants example,cpu,mooncake,ectier-host,...]
    ectier bench connectors --from-json bench-results/connectors.json   # table + plot again

It needs vLLM importable (run it in the environment vLLM is installed in); without it the command
says so in one line and exits 1. The ``mooncake`` variant (vLLM's ``ECMooncakeConnector``, tcp on
loopback) needs the Mooncake client (``mooncake-transfer-engine-non-cuda``) in that environment, and
``cpu`` needs CUDA: without them each is skipped with the reason. ``--from-json`` needs no vLLM (it re-renders a saved result, e.g.
where matplotlib is installed).
"""

from __future__ import annotations

import json
import os
from typing import Any

import click

from ..config import parse_bytes
from ..errors import ConfigError
from .cli import (_console, _machine, _out_dir, _plot, _progress, _tokens_list, elapsed_s, print_written,
                  workdir_option)
from .connectors import DEFAULT_SIZES, plot_connectors, reps_for, summarize, table, verdict
from .report import markdown_table, print_table, write_json

__all__ = ["connectors_cmd"]

VARIANT_NAMES = ("example", "cpu", "mooncake", "ectier-host", "ectier-nvme", "ectier-daemon", "ectier-daemon-nvme")


def _driver():
    """:mod:`.connector_driver`, or a one-line ClickException saying what is missing. Without
    CUDA and without ``VLLM_TARGET_DEVICE``, sets it to ``cpu`` first (vLLM cannot infer a device
    then, and its config raises "Failed to infer device type")."""
    import os

    import torch

    if "VLLM_TARGET_DEVICE" not in os.environ and not torch.cuda.is_available():
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"  # (before vLLM is imported: it reads it then)
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise click.ClickException(
            f"vLLM is not importable ({exc}): `ectier bench connectors` drives vLLM's own connectors; run it "
            "in the environment where vLLM 0.33 is installed") from None
    import importlib.util

    if importlib.util.find_spec("ectier_vllm") is None:  # vLLM loads ECTierConnector from it by name
        raise click.ClickException("ectier's vLLM binding (ectier_vllm) is not importable: install ectier[vllm] "
                                   "or put bindings/ on PYTHONPATH")
    from . import connector_driver

    return connector_driver


def _variants(ctx, param, value):
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in VARIANT_NAMES]
    if bad or not names:
        raise click.BadParameter(f"unknown {bad or value!r}; choose from {', '.join(VARIANT_NAMES)}")
    return tuple(dict.fromkeys(names))


def _budget(ctx, param, value):
    try:
        nbytes = parse_bytes(value, field_name="--budget-bytes")
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None
    if nbytes <= 0:  # (the repetitions per size are this budget over the item's bytes)
        raise click.BadParameter(f"expected more than 0 bytes, got {value!r}")
    return nbytes


def _measure(console, quiet, sizes, variants, budget_bytes, min_reps, workdir, threads,
             step_s) -> list[dict[str, Any]]:
    driver = _driver()
    import torch

    torch.set_num_threads(threads)
    chosen = [v for v in driver.VARIANTS if v.name in variants]
    plan = [(v, n, reps_for(n * driver.WIDTH * 2, budget_bytes, min_reps=min_reps)) for n in sizes for v in chosen]
    results = []
    with _progress(console, quiet) as prog:
        task = prog.add_task("connectors", total=sum(r for _, _, r in plan))
        for v, n, reps in plan:
            prog.update(task, description=f"{v.name} N={n}")
            r = driver.run_variant(v, n, reps, workdir=workdir, advance=lambda k: prog.advance(task, k),
                                   step_s=step_s)
            if "skipped" in r:
                prog.advance(task, reps)
            results.append(r)
    return results


@click.command("connectors")
@click.option("--out", default="bench-results", show_default=True, type=click.Path(file_okay=False),
              callback=_out_dir, help="directory for JSON, markdown and PNG results")
@workdir_option("existing directory for the connectors' files (safetensors files, in-process NVMe stores; "
                "a daemon's socket and store go under /tmp, for a short socket path)")
@click.option("--quiet", "-q", is_flag=True, help="no progress bars")
@click.option("--sizes", default=",".join(map(str, DEFAULT_SIZES)), show_default=True, callback=_tokens_list,
              help="comma-separated N (tokens; each entry is N x 8192 bf16), each 1..16384")
@click.option("--variants", default=",".join(VARIANT_NAMES), show_default=True, callback=_variants,
              help="connectors to run (mooncake: vLLM's ECMooncakeConnector, needs the Mooncake client; cpu: "
                   "ECCPUConnector, needs CUDA; either is skipped with the reason where it cannot run)")
@click.option("--budget-bytes", default="256MiB", show_default=True, callback=_budget,
              help="about how many bytes each (connector, N) moves: items = budget / entry size, "
                   "between --min-reps and 30")
@click.option("--min-reps", default=5, show_default=True, type=click.IntRange(1, 30),
              help="fewest items per (connector, N), after one warm-up item (at most 30 are timed)")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1),
              help="torch intra-op threads of this process (on a busy machine a second thread makes a 1 MiB "
                   "copy wait for the scheduler: 6 ms instead of 0.05 ms on the 2-core dev VM)")
@click.option("--step-ms", default=5.0, show_default=True, type=click.FloatRange(0.1, 1000.0),
              help="milliseconds between two model steps of the producer (its completion calls run once per step)")
@click.option("--from-json", "from_json", default=None, type=click.Path(dir_okay=False, exists=True),
              help="re-render a saved connectors.json (no vLLM needed)")
def connectors_cmd(out, workdir, quiet, sizes, variants, budget_bytes, min_reps, threads, step_ms,
                   from_json) -> None:
    """vLLM's ECExampleConnector, ECCPUConnector (where CUDA is) and ECMooncakeConnector (where the
    Mooncake client imports: producer pushes over Mooncake's TransferEngine, tcp on loopback, CPU
    buffers) vs ECTierConnector (in-process host, host over NVMe, daemon), each driven through
    vLLM's connector calls on (N, 8192) bf16 items, every load checked bitwise: save, until loadable,
    lookup, load, whole consumer side (p50 / p90)."""
    console = _console()
    if from_json:
        try:
            with open(from_json) as f:
                result = json.load(f)
            results = result["results"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise click.BadParameter(f"not a `ectier bench connectors` result ({exc})", param_hint="--from-json")
    else:
        results = _measure(console, quiet, sizes, variants, budget_bytes, min_reps, workdir, threads, step_ms / 1e3)
        result = {"command": "connectors", "machine": _machine(), "sizes": list(sizes), "variants": list(variants),
                  "budget_bytes": budget_bytes, "torch_threads": threads, "step_ms": step_ms, "results": results}
    rows = summarize(results)
    headers, cells = table(rows)
    title = "connectors: ms p50 / p90 per item; vs example = ECExampleConnector's median / this one's (> 1: faster)"
    print_table(console, title, headers, cells)
    lines = verdict(rows)
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    result["summary"] = rows
    result["verdict"] = lines
    result.setdefault("elapsed_s", elapsed_s())
    write_json(result, os.path.join(out, "connectors.json"))
    with open(os.path.join(out, "connectors.md"), "w") as f:
        f.write(f"### connectors\n\n{title}\n\n" + markdown_table(headers, cells) + "\n"
                + "".join(f"- {line}\n" for line in lines))
    written = ["connectors.json", "connectors.md"]
    png = os.path.join(out, "connectors.png")
    _plot(console, written, png, lambda: plot_connectors(rows, png))
    print_written(console, out, written)
    if any(r.get("mismatches") for r in rows):
        raise click.ClickException("a load was not bitwise equal to what was saved (see connectors.json)")

