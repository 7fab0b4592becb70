"""``ectier fsck``: check (or ``--repair``) an NVMe store that no process has open (:mod:`ectier.fsck`)."""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from rich.table import Table

from ..config import format_bytes
from ..errors import EctierError, StoreDamagedError
from .params import console as _console, not_empty

__all__ = ["fsck"]


class _CannotCheck(click.ClickException):
    exit_code = 2


class _Damaged(click.ClickException):
    exit_code = 1


@click.command()
@click.option("--path", "path", required=True, type=click.Path(file_okay=False), callback=not_empty,
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
    from .. import fsck as fsck_mod  # lmdb, torch: only when needed

    try:
        if do_repair:
            result = fsck_mod.repair(path)
            report = result.report
        else:
            result, report = None, fsck_mod.check(path)
    except StoreDamagedError as exc:  # (damaged beyond a report: the index is gone)
        raise _Damaged(str(exc)) from None
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
    from ..tiers.nvme_segment import SEGMENT_NAME  # (imported by the check already)

    console = _console()
    state = "[bold red]damaged[/]" if report.damaged else "[bold green]healthy[/]"
    console.print(f"store {report.path}: {state} (read {'through LMDB' if report.mode == 'lmdb' else 'page by page: LMDB cannot read it'})",
                  soft_wrap=True)
    if report.finished_swap:
        console.print(f"finished first: the swap of a repair killed during it (the store checked is the repaired one; "
                      f"the damaged one is in {report.finished_swap}: delete it when done)", soft_wrap=True)
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
    for d in (d for d in report.damaged_copies if d != report.finished_swap):
        console.print(f"earlier damaged copy: {d} (delete it when done)", soft_wrap=True)
    for d in report.stale_repairs:
        done = result is not None and d in result.removed_stale
        console.print(f"left by a repair that was killed: {d} "
                      f"({'removed' if done else 'the next --repair removes it'})", soft_wrap=True)
    if report.damaged and not report.entries and report.segment_bytes:
        console.print(f"no index entry was found: the {format_bytes(report.segment_bytes)} of {SEGMENT_NAME} "
                      "(payloads, and space freed earlier) carry no keys and cannot be salvaged", soft_wrap=True)
    if result is not None:
        if result.repaired:
            lost = (f"{result.lost} lost" if report.mode == "lmdb" else
                    f"{result.lost} of the {report.entries} found lost, and any whose index entries were on the "
                    f"{report.damaged_pages} damaged page(s): a page scan cannot count those")
            console.print(f"[bold]repaired[/]: {result.salvaged} records ({format_bytes(result.salvaged_bytes)}) in a fresh "
                          f"store, {lost}; the damaged store is in {result.moved_to} (delete it when done)",
                          soft_wrap=True)
        else:
            console.print("nothing to repair")
    elif report.damaged and not report.entries and report.segment_bytes:
        console.print("nothing to repair from: remove the directory, or set nvme.on_damaged: reset", soft_wrap=True)
    elif report.damaged:
        console.print(f"repair: ectier fsck --path {report.path} --repair", soft_wrap=True)
