"""``daemon.socket_mode``: the permission bits of the daemon's socket file, checked and made an
octal string (the checks of :func:`ectier.config_checks.check_daemon`)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    from .config_daemon import DaemonConfig

__all__ = ["check_socket_mode"]


def check_socket_mode(cfg: DaemonConfig) -> None:
    """An int ``daemon.socket_mode`` (JSON's 384, YAML's unquoted ``0600``) made its octal string,
    in place; then the mode checked: at most 0o777 (YAML reads an unquoted ``600`` as the decimal
    600, 0o1130), read and write for the owner, nothing for every user.

    Raises:
        ConfigError: naming ``daemon.socket_mode`` and the fix.
    """
    mode = cfg.socket_mode
    if isinstance(mode, int) and not isinstance(mode, bool):
        if mode < 0:
            raise ConfigError(f"daemon.socket_mode: expected an octal string such as '0600', got {mode!r}")
        if 0o777 < mode <= 0o7777 and not re.fullmatch(r"[0-7]+", str(mode)):  # (else: decimal digits)
            raise ConfigError(f"daemon.socket_mode: {mode:#o} sets setuid/setgid/sticky bits; a socket's "
                              "mode is at most 0o777, e.g. \"0600\"")
        if mode > 0o777:
            quoted = f"0{mode}" if re.fullmatch(r"[0-7]{3}", str(mode)) else "0600"
            raise ConfigError(f"daemon.socket_mode: {mode} is above 0o777 (511); YAML reads an unquoted "
                              f"{mode} as a decimal number, not octal: write it quoted, e.g. \"{quoted}\"")
        object.__setattr__(cfg, "socket_mode", format(mode, "04o"))
    if not isinstance(cfg.socket_mode, str) or not re.fullmatch(r"0?o?[0-7]{3,4}", cfg.socket_mode):
        raise ConfigError(f"daemon.socket_mode: expected an octal string such as '0600', got {cfg.socket_mode!r}")
    if cfg.socket_mode_bits & 0o600 != 0o600:
        raise ConfigError(f"daemon.socket_mode: {cfg.socket_mode} leaves the socket's owner without read "
                          "and write, so nobody but root could connect; use 0600 or 0660")
    if cfg.socket_mode_bits & 0o007:
        raise ConfigError(f"daemon.socket_mode: {cfg.socket_mode} sets permission bits for other users (the last "
                          "digit); only the daemon's user and daemon.allowed_group may connect: use 0600 or 0660")
