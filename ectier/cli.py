"""The ``ectier`` command line (console script ``ectier`` -> :func:`main`).

::

    ectier size 1920x1080 [1024x1024 ...] [--model qwen3-vl] [--json]   tokens, shape, bytes of images
    ectier models [--json]                                               registered models
    ectier demo [--requests 300 --zipf 1.1 --codec raw ...]              the main job (see ectier.demo)
    ectier serve [--config F] [--socket S]                               the cache daemon (foreground)
    ectier stats [--socket S] [--json]                                   a running daemon's stats
    ectier bench tiers | replay | baseline | crossover                     benchmarks (see ectier.bench.cli)
    ectier fsck --path DIR [--repair] [--json]                           check / repair an NVMe store
    ectier --version

This module is the group; each subcommand lives in :mod:`ectier.commands` (one module per group of
commands), ``bench`` in :mod:`ectier.bench.cli`. Bad arguments are usage errors (exit code 2, a
message naming the argument, no traceback). ``size`` and ``models`` need only the token math;
the other commands import torch and the cache lazily.
"""

from __future__ import annotations

import sys

import click

from . import __version__
from .commands.daemon_cmd import serve, stats
from .commands.demo_cmd import demo
from .commands.fsck_cmd import fsck
from .commands.info import models, size

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="ectier", message="%(prog)s %(version)s")
def main() -> None:
    """ectier: a tiered encoder cache (GPU memory -> pinned host memory -> NVMe -> remote store) for
    vision-language-model encoder outputs, keyed by vLLM's mm_hash."""


def _register() -> None:
    from .bench.cli import bench  # click only at import; torch is imported when a bench command runs

    for command in (size, models, demo, serve, stats, fsck, bench):
        main.add_command(command)


_register()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
