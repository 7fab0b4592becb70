"""Option types shared by the ``ectier`` subcommands, and the console they print to.

Each type turns a bad value into a usage error (exit code 2) naming the option, never a traceback.
"""

from __future__ import annotations

from typing import Any, Optional

import click
from rich.console import Console

from ..config import parse_bytes
from ..errors import ConfigError
from ..sizing import ModelSpec, get_model, parse_size

__all__ = ["ImageSize", "ModelName", "ByteSize", "console"]


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


def console() -> Console:
    """The console a subcommand prints its tables to (no syntax highlighting of numbers)."""
    return Console(highlight=False)
