"""What a daemon client raises, and how the daemon's error replies become exceptions."""

from __future__ import annotations

from typing import Any

from .. import errors
from .protocol import ProtocolError

__all__ = ["DaemonUnavailableError", "DaemonFeatureError", "error_from_reply", "reply_results"]


class DaemonUnavailableError(errors.EctierError):
    """The daemon cannot be reached (not running, wrong path, refused this user) or did not answer
    in time (hung, stopped)."""


class DaemonFeatureError(errors.EctierError):
    """The daemon lacks an operation this client asked for (a daemon older than the client)."""


def error_from_reply(error: dict[str, Any]) -> Exception:
    """The exception for an error reply ``{"type", "message"}``: ectier's own types by name,
    a refusal as :class:`DaemonUnavailableError`, anything else an :class:`~ectier.errors.EctierError`."""
    name = str(error.get("type", "EctierError"))
    message = str(error.get("message", "daemon error"))
    if name == "ProtocolError":
        return ProtocolError(message)
    if name == "PermissionError":
        return DaemonUnavailableError(f"the daemon refused this client: {message}")
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.EctierError):
        return cls(message)
    return errors.EctierError(f"{name}: {message}")


def reply_results(msg: dict[str, Any]) -> dict[str, Any]:
    """A reply's results (without ``id`` and ``ok``); an error reply raises its typed error."""
    if not msg.get("ok"):
        raise error_from_reply(msg.get("error") or {})
    msg.pop("id", None)
    msg.pop("ok", None)
    return msg
