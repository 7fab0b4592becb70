"""``ec_connector_extra_config`` → ectier settings. Pure Python: imports neither vLLM nor torch.

Every key of ``--ec-transfer-config '{"ec_connector_extra_config": {...}}'`` the connector reads is
listed in :data:`KEYS`; an unknown key, a wrong type or a bad value raises
:class:`ectier.errors.ConfigError` naming ``ec_connector_extra_config.<key>``. Validation happens
once, when the connector is built (engine start-up), never on the request path.

Keys (see docs/vllm.md for the full table)::

    mode            "inprocess" (default) | "daemon"
    namespace       default: "<model>@<revision>:<dtype>" of the engine
    host, nvme, gpu, remote  in-process mode: ectier tier sub-configs (CacheConfig.host / .nvme /
                    .gpu / .remote, the field names of the YAML config's sections); gpu.device must
                    be the worker's own device (checked when the store opens); remote: a store
                    shared by every node (two-node EPD: the same remote section on both engines)
    config_path     in-process mode: an ectier .yaml/.json config file (instead of host/nvme/gpu/remote)
    socket_path     daemon mode: the socket of `ectier serve` (default: DaemonConfig's default)
    daemon_timeout_s  daemon mode: seconds per daemon call (default 10, at least 0.01)
    daemon_answer_wait_s  daemon mode: seconds a scheduler step may wait for the daemon's answers
    load_timeout_s  how long a request may wait for a promotion before the item counts as a miss
                    and is re-encoded (default 10)
    recompute       true (default): an item whose load would take longer than re-encoding it is a
                    miss (ectier_vllm.recompute); false: always load
    encoder_seconds_per_token  the encoder's cost for that choice (default: learned from this
                    engine's own encoder steps, ec_producer / ec_both)
    save_queue_depth  producer: saves that may wait for the worker's background put thread before
                    new ones are dropped (default 16)
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ectier.config import CacheConfig
from ectier.config_sources import tiers_left_off
from ectier.entry import validate_namespace
from ectier.errors import ConfigError, InvalidKeyError

PREFIX = "ec_connector_extra_config"

KEYS = (
    "mode",
    "namespace",
    "host",
    "nvme",
    "gpu",
    "remote",
    "config_path",
    "socket_path",
    "daemon_timeout_s",
    "daemon_answer_wait_s",
    "load_timeout_s",
    "recompute",
    "encoder_seconds_per_token",
    "save_queue_depth",
)
MODES = ("inprocess", "daemon")
#: default of ``daemon_answer_wait_s``, seconds (docs/vllm.md: chosen by daemon_sched_step_bench)
DEFAULT_ANSWER_WAIT_S = 0.0
#: default of ``daemon_timeout_s``, seconds: far above any call of a healthy daemon (a 256 MiB
#: commit with write-through to a slow disk included), and the one wait a hung daemon costs a
#: worker's load before calls fail fast (it was 30 s: docs/vllm.md)
DEFAULT_DAEMON_TIMEOUT_S = 10.0
TIER_KEYS = ("host", "nvme", "gpu", "remote")


@dataclass(frozen=True)
class ConnectorSettings:
    """The connector's validated settings.

    Fields:
        mode: ``"inprocess"`` (a :class:`~ectier.cache.TieredCache` shared by every connector of the
            process) or ``"daemon"`` (a :class:`~ectier.daemon.client.DaemonClient` per connector).
        namespace: stored identity of every entry (model, revision, dtype).
        cache: in-process mode: the store's :class:`~ectier.config.CacheConfig` (its namespace is
            ``namespace``); ``None`` in daemon mode (the daemon owns its tiers).
        socket_path: daemon mode: the daemon's socket (``None``: DaemonConfig's default).
        daemon_timeout_s: daemon mode: socket timeout per call.
        daemon_answer_wait_s: daemon mode: the longest a scheduler step waits, in all, for the
            daemon's answer to its lookups (seconds, >= 0); an item not answered by then waits for
            a later step (:data:`DEFAULT_ANSWER_WAIT_S`).
        load_timeout_s: seconds a request may stay deferred waiting for a promotion.
        config_path: in-process mode: the ectier config file ``cache`` was read from, if any.
        recompute: answer a miss for an item whose load would take longer than re-encoding it
            (:mod:`ectier_vllm.recompute`). Default ``True``.
        encoder_seconds_per_token: the encoder's seconds per token for that choice; ``None``
            (default): learned from this engine's own encoder steps (a pure ``ec_consumer`` learns
            nothing, so it always loads unless this is set).
        save_queue_depth: saves (items) that may wait for the worker's background put thread;
            a save beyond them is dropped, counted as a save failure.
    """

    mode: str = "inprocess"
    namespace: str = "default"
    cache: CacheConfig | None = field(default_factory=CacheConfig)
    socket_path: str | None = None
    daemon_timeout_s: float = DEFAULT_DAEMON_TIMEOUT_S
    daemon_answer_wait_s: float = DEFAULT_ANSWER_WAIT_S
    load_timeout_s: float = 10.0
    config_path: str | None = None
    recompute: bool = True
    encoder_seconds_per_token: float | None = None
    save_queue_depth: int = 16


def default_namespace(model: str, revision: str | None, dtype: Any) -> str:
    """``"<model>@<revision>:<dtype>"``, e.g. ``"Qwen/Qwen3-VL-30B-A3B-Instruct@main:bfloat16"``.

    ``dtype`` may be a ``torch.dtype`` (``torch.bfloat16`` → ``"bfloat16"``) or a string.
    """
    name = str(dtype)
    if name.startswith("torch."):
        name = name[len("torch.") :]
    return f"{model}@{revision or 'main'}:{name}"


def operator_key(message: str, config_path: str | None) -> str:
    """An ectier error message (``"host.capacity_bytes: ..."``, ``"nvme.path: ..."``, or
    ``"config: cannot read ..."``) restated with the key the operator actually set.

    Inline sub-configs: ``ec_connector_extra_config.host.capacity_bytes: ...``. A field inside the
    ``config_path`` file: ``ec_connector_extra_config.config_path ('<file>'): host.capacity_bytes: ...``.
    The file itself unreadable or not a config: ``ec_connector_extra_config.config_path: cannot read ...``.
    """
    if config_path is None:
        return f"{PREFIX}.{message}"
    if message.startswith("config: "):  # about the file itself; the message names the file
        return f"{PREFIX}.config_path: {message[len('config: '):]}"
    message = re.sub(r" \(in '[^']*'\)$", "", message, flags=re.M)  # the file is named in front already
    return f"{PREFIX}.config_path ({config_path!r}): {message}"


def _seconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise ConfigError(f"{PREFIX}.{key}: expected a finite number of seconds > 0, got {value!r}")
    return float(value)


def settings_from_extra_config(extra: Mapping[str, Any] | None, *, default_ns: str) -> ConnectorSettings:
    """Validate ``ec_connector_extra_config`` and build :class:`ConnectorSettings`.

    Args:
        extra: the mapping from vLLM's ``ECTransferConfig.ec_connector_extra_config`` (``None``: {}).
        default_ns: the namespace used when ``namespace`` is not given (:func:`default_namespace`).

    Raises:
        ConfigError: the message names ``ec_connector_extra_config.<key>`` (or the nested ectier
            field, e.g. ``ec_connector_extra_config.host.capacity_bytes``).
    """
    extra = {} if extra is None else extra
    if not isinstance(extra, Mapping):
        raise ConfigError(f"{PREFIX}: expected a mapping, got {type(extra).__name__}")
    _check_known(extra)
    mode = extra.get("mode", "inprocess")
    if mode not in MODES:
        raise ConfigError(f"{PREFIX}.mode: expected one of {', '.join(MODES)}, got {mode!r}")
    common = _common_fields(extra, default_ns)
    if mode == "daemon":
        return _daemon_settings(extra, common)
    return _inprocess_settings(extra, common)


def _check_known(extra: Mapping[str, Any]) -> None:
    """Raise ConfigError for a key the connector does not read (with the closest known key)."""
    for key in extra:
        if key not in KEYS:
            import difflib

            close = difflib.get_close_matches(str(key), KEYS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{PREFIX}.{key}: unknown key{hint}; known keys: {', '.join(KEYS)}")


def _check_namespace(namespace: Any) -> None:
    """The namespace as every store takes it (ectier's ``validate_namespace``, what a daemon and
    ``TieredCache`` check each call against): a non-empty string of at most 4096 bytes of UTF-8,
    no lone surrogate. Checked at start-up in both modes (in daemon mode nothing else would)."""
    if not isinstance(namespace, str) or not namespace:
        raise ConfigError(f"{PREFIX}.namespace: expected a non-empty string, got {namespace!r}")
    try:
        validate_namespace(namespace)
    except InvalidKeyError as exc:
        raise ConfigError(f"{PREFIX}.{exc}") from None


def _common_fields(extra: Mapping[str, Any], default_ns: str) -> dict[str, Any]:
    """The checked keys both modes read, as :class:`ConnectorSettings` fields."""
    namespace = extra.get("namespace", default_ns)
    _check_namespace(namespace)
    load_timeout_s = _seconds("load_timeout_s", extra.get("load_timeout_s", 10.0))
    recompute = extra.get("recompute", True)
    if not isinstance(recompute, bool):
        raise ConfigError(f"{PREFIX}.recompute: expected true or false, got {recompute!r}")
    per_token = extra.get("encoder_seconds_per_token")
    if per_token is not None:
        per_token = _seconds("encoder_seconds_per_token", per_token)
    depth = extra.get("save_queue_depth", 16)
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= 4096:
        raise ConfigError(f"{PREFIX}.save_queue_depth: expected an int from 1 to 4096 (items), got {depth!r}")
    return {"mode": extra.get("mode", "inprocess"), "namespace": namespace, "load_timeout_s": load_timeout_s,
            "recompute": recompute, "encoder_seconds_per_token": per_token, "save_queue_depth": depth}


#: the shortest ``daemon_timeout_s``, seconds: below it no call could ever be answered (a round
#: trip to the daemon takes tens of microseconds idle, milliseconds under load), so every
#: lookup and save would fail
MIN_DAEMON_TIMEOUT_S = 0.01
#: the longest ``socket_path`` in bytes: an AF_UNIX address holds 108 bytes with its NUL
MAX_SOCKET_PATH_BYTES = 107


def _socket_path(value: Any) -> str | None:
    """``socket_path``: ``None`` (DaemonConfig's default) or a path a Unix socket can have."""
    if value is None:
        return None
    key = f"{PREFIX}.socket_path"
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: expected a non-empty path string, got {value!r}")
    if "\0" in value:
        raise ConfigError(f"{key}: contains a NUL byte (\\0), which no path may hold: {value!r}")
    try:
        size = len(os.fsencode(value))
    except UnicodeEncodeError:
        raise ConfigError(f"{key}: cannot be encoded for the file system: {value!r}") from None
    if size > MAX_SOCKET_PATH_BYTES:
        raise ConfigError(f"{key}: {size} bytes, longer than the {MAX_SOCKET_PATH_BYTES} bytes a Unix socket "
                          f"path may have; use a shorter path (and the same in the daemon's daemon.socket_path)")
    return value


def _daemon_settings(extra: Mapping[str, Any], common: dict[str, Any]) -> ConnectorSettings:
    """Daemon mode: the socket and its timeouts; tier sub-configs and ``config_path`` refused."""
    daemon_timeout_s = _seconds("daemon_timeout_s", extra.get("daemon_timeout_s", DEFAULT_DAEMON_TIMEOUT_S))
    if daemon_timeout_s < MIN_DAEMON_TIMEOUT_S:
        raise ConfigError(f"{PREFIX}.daemon_timeout_s: at least {MIN_DAEMON_TIMEOUT_S} s (one call to the daemon "
                          f"must have time to be answered, else every lookup and save fails), got {daemon_timeout_s!r}")
    answer_wait_s = extra.get("daemon_answer_wait_s", DEFAULT_ANSWER_WAIT_S)
    if isinstance(answer_wait_s, bool) or not isinstance(answer_wait_s, (int, float)) or not 0 <= answer_wait_s <= 1:
        raise ConfigError(f"{PREFIX}.daemon_answer_wait_s: expected a number of seconds from 0 to 1, got {answer_wait_s!r}")
    socket_path = _socket_path(extra.get("socket_path"))
    for key in (*(k for k in TIER_KEYS if k in extra), *(["config_path"] if extra.get("config_path") is not None else [])):
        raise ConfigError(
            f"{PREFIX}.{key}: not used in daemon mode (the daemon owns the tiers: set them in the "
            f"config of `ectier serve --config ...`)"
        )
    return ConnectorSettings(cache=None, socket_path=socket_path, daemon_timeout_s=daemon_timeout_s,
                             daemon_answer_wait_s=float(answer_wait_s), **common)


def _inprocess_settings(extra: Mapping[str, Any], common: dict[str, Any]) -> ConnectorSettings:
    """In-process mode: the store's CacheConfig from the tier sub-configs or ``config_path``."""
    for key in ("socket_path", "daemon_timeout_s", "daemon_answer_wait_s"):
        if key in extra and extra[key] is not None:
            raise ConfigError(f"{PREFIX}.{key}: only used in daemon mode (set \"mode\": \"daemon\")")
    tiers = {k: extra[k] for k in TIER_KEYS if k in extra}
    config_path = extra.get("config_path")
    if config_path is not None and tiers:
        raise ConfigError(
            f"{PREFIX}.config_path: give either config_path or {'/'.join(tiers)} sub-configs, not both"
        )
    for key, value in tiers.items():
        if not isinstance(value, Mapping):
            raise ConfigError(f"{PREFIX}.{key}: expected a mapping of ectier {key} tier fields, got {type(value).__name__}")
    namespace = common["namespace"]
    if config_path is not None:
        if not isinstance(config_path, str) or not config_path:
            raise ConfigError(f"{PREFIX}.config_path: expected a path string, got {config_path!r}")
        try:
            cache = CacheConfig.load(config_path).replace(namespace=namespace)
        except ConfigError as exc:
            raise ConfigError(problems=[operator_key(m, config_path) for m in exc.problems]) from exc
    else:
        cache = _inline_cache_config(namespace, tiers)
    return ConnectorSettings(cache=cache, socket_path=None, config_path=config_path, **common)


def _inline_cache_config(namespace: str, tiers: dict[str, Any]) -> CacheConfig:
    """The store's CacheConfig from the inline ``host``/``nvme``/``gpu``/``remote`` sub-configs:
    every bad field at once, and a tier sub-config that sets fields but not the one that switches
    the tier on (``nvme.path``, ``remote.backend``, ``gpu.capacity_bytes``: ``tiers_left_off``) is
    refused, never a store without that tier."""
    problems: list[str] = []
    cache = None
    try:
        cache = CacheConfig.from_dict({"namespace": namespace, **tiers})
    except ConfigError as exc:
        problems = list(exc.problems)
    problems += tiers_left_off(tiers, problems)
    if problems:
        raise ConfigError(problems=[operator_key(m, None) for m in problems])
    return cache
