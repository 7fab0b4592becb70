"""Where a :class:`~ectier.config.CacheConfig` comes from: nested mappings, JSON/YAML files, ``ECTIER_*``.

The ``CacheConfig.from_*`` class methods and ``CacheConfig.load`` call these functions; use those.
Every bad field of the input is reported at once: one :class:`~ectier.errors.ConfigError` whose
``problems`` hold one message per field (first found first, each starting with the dotted field
name or, for a variable that cannot be read at all, the variable's name). Errors from
:func:`config_from_env` also carry ``env_vars``: the variables the bad values came from.
A key given twice in one mapping of a JSON or YAML file is such a problem too (named by its dotted
path, with the file and, for YAML, the lines), never "the last one wins"; so is a tier section of a
file that sets the tier's fields but not the one that switches it on (:func:`tiers_left_off`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Mapping

from .config import CacheConfig
from .config_checks import Problems, parse_bytes
from .errors import ConfigError

__all__ = ["env_problems_alone", "config_from_dict", "config_from_json", "config_from_yaml", "load_config", "config_from_env",
           "as_config", "tiers_left_off", "tiers_judged_after_env", "TIER_SWITCHES"]

#: The field that switches each optional tier on: (field, what to set it to, its "off" value). A
#: section a person wrote (a config file; the vLLM connector's inline sections) that sets fields of
#: the tier but not this one is an error (:func:`tiers_left_off`): the tier would stay off, silently.
TIER_SWITCHES = {
    "nvme": ("path", "the directory to store in", "null"),
    "remote": ("backend", "'redis' or 'mooncake'", "'none'"),
    "gpu": ("capacity_bytes", "the GPU tier's budget, e.g. '4GiB'", "0"),
}


#: set while a file is read as the base of environment variables (``config_from_env``, ``ectier
#: serve --config``): its tier sections are judged after the variables are overlaid. The set holds
#: the sections whose switch such a file gives (even as its off value: that section is not judged)
_TIERS_JUDGED_LATER: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("tiers_judged_later", default=None)


@contextlib.contextmanager
def tiers_judged_after_env() -> Iterator[None]:
    """Inside: a config file read is not refused for a tier section that switches nothing on,
    because environment variables (``ECTIER_NVME__PATH``, ...) may switch it on; the config they
    make (:func:`config_from_env`) is judged instead. Nested: one context (what the file
    switched, seen by the judgement)."""
    if _TIERS_JUDGED_LATER.get() is not None:
        yield
        return
    token = _TIERS_JUDGED_LATER.set(set())
    try:
        yield
    finally:
        _TIERS_JUDGED_LATER.reset(token)


def as_config(config: Any) -> CacheConfig:
    """``TieredCache``'s ``config`` argument as a :class:`CacheConfig`: ``None`` (the defaults), a
    mapping (:meth:`CacheConfig.from_dict`), a ``.json``/``.yaml`` path (:meth:`CacheConfig.load`).

    Raises:
        ConfigError: anything else, or a bad config.
    """
    if config is None:
        return CacheConfig()
    if isinstance(config, Mapping):
        return CacheConfig.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return CacheConfig.load(config)
    if not isinstance(config, CacheConfig):
        raise ConfigError(f"config: expected a CacheConfig, a mapping or a .json/.yaml path, got {type(config).__name__}")
    return config


def config_from_dict(cls: type, data: Mapping[str, Any]) -> Any:
    """Build ``cls`` (a config dataclass) from a nested mapping; see ``CacheConfig.from_dict``."""
    return _build(cls, data, prefix="")


def config_from_json(cls: type, source: str | os.PathLike) -> Any:
    """Build from a JSON file path (or a JSON text that starts with ``{``)."""
    text = _read_text(source, "JSON")
    try:
        data = json.loads(text, object_pairs_hook=_JsonObject)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config: invalid JSON in {_describe(source)}: {exc}") from exc
    dups = [(dotted, ()) for dotted in _json_duplicates(data, "")]
    return _build_from_file(cls, _expect_mapping(data, source), dups, source)


_LOADER = None


def _yaml_loader() -> type:
    """PyYAML's SafeLoader, reading floats as YAML 1.2 does: ``1e9`` and ``5e-3`` are numbers
    (YAML 1.1, PyYAML's default, wants a dot and a signed exponent: ``1.0e+9``; else a string)."""
    global _LOADER
    if _LOADER is None:
        import re

        import yaml

        class Loader(yaml.SafeLoader):
            pass

        Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
            r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
            r"|[0-9][0-9_]*[eE][-+]?[0-9]+|\.(?:inf|Inf|INF)|[-+]\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
            list("-+0123456789."))
        _LOADER = Loader
    return _LOADER


def config_from_yaml(cls: type, source: str | os.PathLike) -> Any:
    """Build from a YAML file path (or a YAML text containing a newline)."""
    import yaml

    text = _read_text(source, "YAML")
    try:  # yaml.load's steps, with the node tree checked for duplicate keys before it is built
        loader = _yaml_loader()(text)  # (this reads the text: a ReaderError for a bad character)
        try:
            node = loader.get_single_node()
            dups = _yaml_duplicates(node, "", set()) if node is not None else []
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise ConfigError(f"config: invalid YAML in {_describe(source)}: {exc}") from exc
    return _build_from_file(cls, _expect_mapping({} if data is None else data, source), dups, source)


class _JsonObject(dict):
    """A JSON object as ``json.loads(object_pairs_hook=)`` builds it: a dict (the last value of a
    repeated name wins, as without the hook) that remembers the names given more than once."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.repeated = [key for key, n in Counter(key for key, _ in pairs).items() if n > 1]


def _json_duplicates(data: Any, prefix: str) -> list[str]:
    """The dotted names of every key given twice in one object of ``data``, depth first."""
    found: list[str] = []
    if isinstance(data, _JsonObject):
        found.extend(f"{prefix}{key}" for key in data.repeated)
        for key, value in data.items():
            found.extend(_json_duplicates(value, f"{prefix}{key}."))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found.extend(_json_duplicates(value, f"{prefix.rstrip('.')}[{i}]."))
    return found


def _yaml_duplicates(node: Any, prefix: str, seen: set[int]) -> list[tuple[str, tuple[int, ...]]]:
    """``(dotted name, the 1-based lines of its occurrences)`` of every key given twice in one
    mapping of the YAML node tree under ``node``, depth first (``<<`` merges are not repeats: a
    key next to a merge overrides the merged one, as YAML means it to)."""
    import yaml

    if id(node) in seen:  # an alias of a node already walked (or a recursive one)
        return []
    seen.add(id(node))
    found: list[tuple[str, tuple[int, ...]]] = []
    if isinstance(node, yaml.MappingNode):
        lines: dict[str, list[int]] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            lines.setdefault(str(key_node.value), []).append(key_node.start_mark.line + 1)
            found.extend(_yaml_duplicates(value_node, f"{prefix}{key_node.value}.", seen))
        found[:0] = [(f"{prefix}{key}", tuple(at)) for key, at in lines.items() if len(at) > 1]
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found.extend(_yaml_duplicates(item, f"{prefix.rstrip('.')}[{i}].", seen))
    return found


def _build_from_file(cls: type, data: Mapping[str, Any], dups: list[tuple[str, tuple[int, ...]]],
                             source: str | os.PathLike) -> Any:
    """``config_from_dict(cls, data)`` of what a file (or text) ``source`` held. Raises a
    :class:`ConfigError` with one problem per key the file gave twice (``dups``: dotted names, with
    the lines of each occurrence where known), then the problems of the rest of the file, each
    ending with the file's name (those of a repeated key or section left out: only one of its
    values was judged), and, for a :class:`CacheConfig`, one per tier section that switches
    nothing on (:func:`tiers_left_off`)."""
    described = _describe(source)
    where_from = "" if described == "text" else f" (in {described})"
    problems = []
    for dotted, lines in dups:
        where = f" (lines {', '.join(map(str, lines[:-1]))} and {lines[-1]})" if lines else ""
        problems.append(f"{dotted}: given more than once in {described}{where}; keep one")
    try:
        config = config_from_dict(cls, data)
    except ConfigError as exc:  # every other problem, named with the file it is in
        problems.extend(f"{m}{where_from}" for m in exc.problems
                        if not any(_names(_judged(m), d) for d, _ in dups))
    later = _TIERS_JUDGED_LATER.get()
    if cls is CacheConfig and later is None:  # a tier section that switches nothing on
        problems.extend(f"{m}{where_from}" for m in tiers_left_off(data, problems))
    elif later is not None:  # judged with the variables over it; a switch given here counts then
        later.update(section for section, (switch, _, _) in TIER_SWITCHES.items()
                     if isinstance(data.get(section), Mapping) and switch in data[section])
    if problems:
        raise ConfigError(problems=problems) from None
    return config


def tiers_left_off(data: Mapping[str, Any], judged: list[str] | tuple[str, ...] = ()) -> list[str]:
    """One problem per tier section of ``data`` (a config mapping a person wrote) that sets fields
    of its tier but not the field that switches the tier on (:data:`TIER_SWITCHES`): e.g.
    ``remote: {addresses: ...}`` without ``backend``, or ``nvme: {capacity_bytes: 1TiB}`` without
    ``path``, which would start without that tier and say nothing. A switch given, even as its
    off value (``nvme.path: null``, ``remote.backend: none``, ``gpu.capacity_bytes: 0``), an empty
    or null section, and a section some message of ``judged`` (the problems already found) names,
    are left alone. ``CacheConfig.from_dict`` does not call this (a program's mapping may set a
    tier's fields to switch it on later); files (``CacheConfig.load``, ``from_yaml``,
    ``from_json``) and the vLLM connector's inline sections do."""
    problems = []
    for section, (switch, what, off) in TIER_SWITCHES.items():
        fields = data.get(section)
        if not isinstance(fields, Mapping) or not fields or switch in fields:
            continue
        if any(_names(_judged(m), section) for m in judged):
            continue
        given = ", ".join(f"{section}.{key}" for key in fields)
        problems.append(
            f"{section}.{switch}: not set, so there is no {section} tier and {given} would do nothing; "
            f"set {section}.{switch} ({what}), or drop the section (or set {section}.{switch}: {off} "
            f"to keep the tier off)")
    return problems


def load_config(cls: type, path: str | os.PathLike) -> Any:
    """Build from a ``.json``, ``.yaml`` or ``.yml`` file, chosen by suffix."""
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        return config_from_json(cls, Path(path))
    if suffix in (".yaml", ".yml"):
        return config_from_yaml(cls, Path(path))
    raise ConfigError(f"config: {os.fspath(path)!r} must end in .json, .yaml or .yml")


def config_from_env(cls: type, env: Mapping[str, str], prefix: str, base: CacheConfig | None) -> Any:
    """Overlay the ``prefix`` variables of ``env`` on ``base``; see ``CacheConfig.from_env``.

    Raises:
        ConfigError: every unknown variable and bad value at once; ``env_vars`` names the
            variables at fault (``<prefix>CONFIG`` when the file it names is bad).
    """
    outer = _TIERS_JUDGED_LATER.get() is not None  # the caller read ``base`` from a file under the context
    with tiers_judged_after_env():  # (one context: what a file read here or by the caller switched)
        return _config_from_env(cls, env, prefix, base, outer)


def _config_from_env(cls: type, env: Mapping[str, str], prefix: str, base: CacheConfig | None, outer: bool) -> Any:
    file_read = None
    if base is None:
        file = env.get(prefix + "CONFIG")
        file_read = file or None
        try:
            base = load_config(cls, file) if file else cls()
        except ConfigError as exc:
            raise ConfigError(problems=exc.problems, env_vars=(prefix + "CONFIG",)) from exc
    data = base.to_dict()
    problems: list[str] = []
    bad_vars: list[str] = []
    set_by: dict[str, str] = {}  # dotted field -> the variable that set it
    for name, raw in env.items():
        if not name.startswith(prefix) or name == prefix + "CONFIG":
            continue
        path = name[len(prefix):].lower().split("__")
        try:
            target = _env_target(data, name, path, prefix)
            set_by[".".join(path)] = name
            target[path[-1]] = _env_value(name, raw, _field_type(cls, path))
        except ConfigError as exc:
            problems.extend(exc.problems)
            bad_vars.append(name)
    try:
        config = cls.from_dict(data)
    except ConfigError as exc:
        for message in exc.problems:
            names = [var for dotted, var in set_by.items() if _names(message, dotted)]
            problems.append(message + (f" (from {', '.join(names)})" if names else ""))
            bad_vars.extend(names)
        config = None
    if config is not None and cls is CacheConfig:  # the file under them judged here (deferred), not a program's base
        judge_base = outer or (file_read is not None)
        switched = _TIERS_JUDGED_LATER.get() or set()
        for message, names in _env_tiers_left_off(config, set_by, judge_base, switched):
            problems.append(message + (f" (in {file_read!r})" if file_read and not names else ""))
            bad_vars.extend(names or ([prefix + "CONFIG"] if file_read else []))
    if problems:
        raise ConfigError(problems=problems, env_vars=tuple(dict.fromkeys(bad_vars)))
    return config


def _env_tiers_left_off(config: CacheConfig, set_by: dict[str, str], judge_base: bool,
                        switched: set[str] = frozenset()) -> list[tuple[str, list[str]]]:
    """``(problem, variables)`` per tier left off whose fields the variables set (``set_by``:
    dotted field -> variable) or, with ``judge_base`` (a file read under them), set away from
    their defaults: as :func:`tiers_left_off` for a file's section, judged on the config they
    make together. A switch a variable sets (``ECTIER_NVME__PATH=null``: the tier off on purpose)
    passes the section; one the file gives (``switched``) passes the file's fields."""
    out = []
    for section, (switch, what, off) in TIER_SWITCHES.items():
        tier = getattr(config, section)
        if tier.enabled or f"{section}.{switch}" in set_by:
            continue
        default = type(tier)()
        from_file = judge_base and section not in switched
        changed = [f"{section}.{f.name}" for f in dataclasses.fields(tier) if f.name != switch and (
            f"{section}.{f.name}" in set_by or from_file and getattr(tier, f.name) != getattr(default, f.name))]
        if changed:
            names = [var for dotted, var in set_by.items() if dotted in changed]
            out.append((f"{section}.{switch}: not set, so there is no {section} tier and {', '.join(names or changed)} "
                        f"would do nothing; set {section}.{switch} ({what}) too, or leave those unset", names))
    return out


# --------------------------------------------------------------------------------------- helpers


def _judged(message: str) -> str:
    """``message`` without an unknown key's suggestions ("did you mean host?", "(known: ...)")
    and the file it was found in ("(in '<path>')", whose name may be a section's): the names it
    is about."""
    message = re.sub(r" \(in '.*'\)$", "", message)
    return re.sub(r"; did you mean [^?]*\?", "", message.split(" (known:")[0])


def _names(message: str, dotted: str) -> bool:
    """Whether ``message`` names the field (or section) ``dotted`` as a whole word."""
    return re.search(rf"(?<![\w.]){re.escape(dotted)}(?!\w)", message) is not None


def _env_target(data: dict[str, Any], name: str, path: list[str], prefix: str) -> dict[str, Any]:
    """The section dict of ``data`` that the variable ``name`` (split into ``path``) sets a field of."""
    target = data
    sections = [k for k, v in data.items() if isinstance(v, dict)]
    for part in path[:-1]:
        if not isinstance(target.get(part), dict):
            hint = difflib.get_close_matches(part, sections, n=1) if target is data else []
            raise ConfigError(f"{name}: no config section {part!r}" + (
                f"; did you mean {prefix}{'__'.join([hint[0], *path[1:]]).upper()}?" if hint else
                f" (sections: {', '.join(sections)})" if target is data else ""))
        target = target[part]
    leaf = path[-1]
    if leaf not in target or isinstance(target[leaf], dict):
        known = [k for k, v in target.items() if not isinstance(v, dict)]
        hint = difflib.get_close_matches(leaf, known, n=1)
        if not hint and len(path) == 1:  # ECTIER_HOST_CAPACITY_BYTES: a section and a field, one "_" apart
            hint = [f"{s}__{leaf[len(s) + 1:]}" for s in sections
                    if leaf.startswith(s + "_") and not isinstance(data[s].get(leaf[len(s) + 1:], {}), dict)][:1]
        raise ConfigError(
            f"{name}: unknown setting {'.'.join(path)!r}"
            + (f"; did you mean {prefix}{'__'.join(path[:-1] + hint).upper()}?" if hint else "")
        )
    return target


def _field_type(cls: type, path: list[str]) -> str:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    f = fields[path[0]]
    if len(path) == 1:
        return str(f.type)
    return _field_type(f.default_factory(), path[1:]) if f.default_factory is not dataclasses.MISSING else ""  # type: ignore[misc]


def _env_value(name: str, raw: str, type_text: str) -> Any:
    low = raw.strip().lower()
    if low in ("none", "null") and "None" in type_text:
        return None
    if "bool" in type_text and "int" not in type_text:
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}: expected true/false, got {raw!r}")
    if "float" in type_text:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{name}: expected a number of seconds, got {raw!r}") from None
    if "int" in type_text:
        if name.upper().endswith("_BYTES"):
            return raw.strip()  # parsed (with units) by from_dict
        try:
            return int(raw.strip())
        except ValueError:
            raise ConfigError(f"{name}: expected an integer, got {raw!r}") from None
    return raw


def _build(cls: type, data: Mapping[str, Any], *, prefix: str) -> Any:
    """``cls(**data)`` with nested sections built recursively; every bad field reported at once."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    p = Problems()
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            hint = difflib.get_close_matches(str(key), list(fields), n=1)
            with p.check(dotted):
                raise ConfigError(
                    f"{dotted}: unknown setting" + (f"; did you mean {prefix}{hint[0]}?" if hint else "")
                    + f" (known: {', '.join(fields)})"
                )
            continue
        f = fields[key]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]
        with p.check(dotted):
            if dataclasses.is_dataclass(default):
                if isinstance(value, type(default)):
                    kwargs[key] = value
                else:
                    kwargs[key] = _build(type(default), value if value is not None else {}, prefix=dotted + ".")
            elif key.endswith("_bytes") and value is not None:
                kwargs[key] = parse_bytes(value, field_name=dotted)
            else:
                kwargs[key] = value
    if p.messages:
        _check_the_rest(cls, kwargs, p)
        p.raise_if_any()
    try:
        return cls(**kwargs)
    except TypeError as exc:  # pragma: no cover - every field has a default
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {exc}") from exc


def _check_the_rest(cls: type, kwargs: dict[str, Any], p: Problems) -> None:
    """Some fields failed before ``cls`` could be built: build it without them (defaults in their
    place) to find the problems of the other fields too, dropping any problem that names a failed
    field (a check across fields would otherwise judge a default the user did not choose)."""
    try:
        cls(**kwargs)
    except ConfigError as exc:
        p.messages.extend(m for m in exc.problems if not any(_names(m, name) for name in p.failed))


def _read_text(source: str | os.PathLike, kind: str) -> str:
    if isinstance(source, str) and (source.lstrip().startswith("{") or "\n" in source):
        return source
    try:
        return Path(source).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"config: cannot read {kind} file {os.fspath(source)!r}: {exc.strerror}") from exc
    except ValueError as exc:  # a NUL in the path; a file that is not UTF-8 (UnicodeDecodeError)
        raise ConfigError(f"config: cannot read {kind} file {os.fspath(source)!r}: {exc}") from exc


def _describe(source: str | os.PathLike) -> str:
    text = isinstance(source, str) and ("\n" in source or source.lstrip().startswith("{"))
    return "text" if text else repr(os.fspath(source))


def _expect_mapping(data: Any, source: str | os.PathLike) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        words = {type(None): "null", list: "a list", str: "a string", bool: "a boolean"}
        kind = words.get(type(data), type(data).__name__)
        raise ConfigError(f"config: {_describe(source)} must hold a mapping at top level, got {kind}")
    return data


_DOTTED = re.compile(r"\b(?:host|gpu|nvme|remote|daemon)\.[a-z_]+\b")


def env_problems_alone() -> tuple[list[str], tuple[str, ...]]:
    """``(problems, variables)``: the ``ECTIER_*`` variables' own problems, judged over the
    defaults (reported beside a bad config file, which would otherwise hide them): bad values and
    unknown names; a tier that only the file would have switched on is not judged. A problem is
    kept when every dotted field it names (``host.capacity_bytes``) is one a variable sets."""
    try:
        with tiers_judged_after_env():
            CacheConfig.from_env(base=CacheConfig())
    except ConfigError as exc:
        # only what the variables are wrong about alone: a check across fields (view_pin_bytes
        # against host.capacity_bytes, say) judged against defaults would blame a good variable
        mine = {v[len("ECTIER_"):].lower().replace("__", ".") for v in exc.env_vars}
        kept = [m for m in exc.problems if m.startswith("ECTIER_")
                or "would do nothing" not in m and set(_DOTTED.findall(m)) <= mine]
        return kept, tuple(v for v in exc.env_vars if any(v in m or v[len("ECTIER_"):].lower().replace("__", ".") in m
                                                           for m in kept))
    return [], ()
