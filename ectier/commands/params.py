"""Option types shared by the ``ectier`` subcommands, and the console they print to.

Each type turns a bad value into a usage error (exit code 2) naming the option, never a traceback.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any, Iterator, Optional

import click
from rich.console import Console

from ..config import parse_bytes
from ..errors import ConfigError
from ..sizing import ModelSpec, get_model, parse_size

__all__ = ["ImageSize", "ModelName", "ByteSize", "console", "not_empty", "sigterm_exits"]


class _Parsed(click.ParamType):
    """A value given as text, parsed by :meth:`parse`; one of :attr:`parsed_type` (a default, a
    value parsed already) passes as it is."""

    parsed_type: type = object

    def parse(self, value: str) -> Any:
        raise NotImplementedError

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> Any:
        if isinstance(value, self.parsed_type):
            return value
        try:
            return self.parse(value)
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)


class ImageSize(_Parsed):
    """``WIDTHxHEIGHT`` in pixels (``1920x1080``, ``1920×1080``, ``1920,1080``) -> ``(w, h)``."""

    name = "WxH"
    parsed_type = tuple

    def parse(self, value: str) -> tuple[int, int]:
        return parse_size(value)


class ModelName(_Parsed):
    """A registered model name or alias (any case) -> :class:`~ectier.sizing.ModelSpec`."""

    name = "MODEL"
    parsed_type = ModelSpec

    def parse(self, value: str) -> ModelSpec:
        return get_model(value)


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


def console(stderr: bool = False) -> Console:
    """The console a subcommand prints its tables to (no syntax highlighting of numbers);
    ``stderr``: on standard error (standard output then carries data, e.g. ``--json -``)."""
    return Console(highlight=False, stderr=stderr)


@contextlib.contextmanager
def sigterm_exits() -> Iterator[None]:
    """While the block runs, SIGTERM (what ``timeout`` and service managers send) exits with code
    143 through ``SystemExit`` in the main thread, as Ctrl-C's ``KeyboardInterrupt`` does, so the
    ``finally`` blocks that remove temporary stores run; the previous handler comes back after.
    Off the main thread (no signal handler can be set there) it does nothing."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    if main:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        if main:  # (None: a handler set outside Python, which cannot be put back: the default then)
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def not_empty(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """Refuse an empty path (``--socket ""`` took the default socket, ``--path ""`` the current
    directory, silently)."""
    if value is not None and not str(value).strip():
        raise click.BadParameter("an empty path; give one, or leave the option out where it has a default")
    return value


def zipf_exponent(ctx: click.Context, param: click.Parameter, value: Optional[float]) -> Optional[float]:
    """``--zipf``: a finite number >= 0, refused by the option's name (a ``FloatRange`` lets NaN
    through, and the stream generator's own refusal named ``zipf:``, no option)."""
    if value is not None and not (value >= 0 and value != float("inf")):
        raise click.BadParameter(f"{value} is not a finite number >= 0 (0 = uniform popularity)")
    return value
