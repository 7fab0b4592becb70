"""``ectier size`` and ``ectier models``: the token math of images and the registered models (no
torch, no cache: :mod:`ectier.sizing` only)."""

from __future__ import annotations

import json
from typing import Any

import click
from rich.table import Table

from ..config import format_bytes
from ..errors import ConfigError
from ..sizing import DEFAULT_MODEL, MODELS, ImageTokens, ModelSpec, image_tokens
from .params import ImageSize, ModelName, console as _console

__all__ = ["size", "models"]


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


@click.command()
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


@click.command()
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
