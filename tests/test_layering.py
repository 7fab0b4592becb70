"""Imports point down only (docs/architecture.md, "Layers"): checked by parsing every module with ``ast``.

Nothing is imported. Every ``.py`` file under ``ectier/`` must belong to exactly one layer of
:data:`LAYERS`; a new module that is in none fails :func:`test_every_module_has_a_layer` with its
name, so adding a module means deciding where it sits.

Rules:

- a module may import ``ectier`` modules of its own layer or of a lower one (lower ``rank``) only;
- each layer lists third-party top-level packages it must not import (the pure-Python layers
  stay free of torch and lmdb, so they import and test without either);
- nothing in ``ectier`` imports the vLLM binding (``bindings`` / ``ectier_vllm``).

Every import counts: module level, inside functions (lazy imports), under ``if TYPE_CHECKING``,
and ``importlib.import_module("...")`` / ``__import__("...")`` calls with a constant name.
``from ectier import X`` where ``X`` is not a submodule resolves to the package facade
``ectier`` (``ectier/__init__.py``), which sits on top of the cache.
"""

from __future__ import annotations

import ast
import fnmatch
import pathlib
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ectier"


@dataclass(frozen=True)
class Layer:
    name: str
    rank: int
    modules: tuple[str, ...]  # fnmatch patterns over dotted module names
    forbidden_external: tuple[str, ...] = ()  # top-level packages this layer must not import


GPU_AND_STORAGE = ("torch", "lmdb", "cupy", "vllm", "triton")
EVERYWHERE_FORBIDDEN = ("bindings", "ectier_vllm")

#: Lowest first. A module may import ectier modules whose layer rank is <= its own.
LAYERS: tuple[Layer, ...] = (
    Layer("errors", 0, ("ectier.errors",), GPU_AND_STORAGE),
    Layer(
        "pure",
        1,
        (
            "ectier.config",
            "ectier.config_checks",
            "ectier.config_remote",
            "ectier.config_daemon",
            "ectier.config_modes",
            "ectier.config_sources",
            "ectier.configdoc",
            "ectier.entry",
            "ectier.forks",
            "ectier.policy",
            "ectier.arena",
            "ectier.index",
            "ectier.codec",
            "ectier.zstd_frames",
            "ectier.record",
            "ectier.sizing",
            "ectier.cpus",
            "ectier.stats",
            "ectier.handles",
            "ectier.catalog",
            "ectier.models",
            "ectier.logutil",
        ),
        GPU_AND_STORAGE,
    ),
    Layer("tensors-and-tiers", 2, ("ectier.tensors", "ectier.copy", "ectier.pinning", "ectier.tiers", "ectier.tiers.*")),
    Layer("stack-and-mover", 3, ("ectier.stack", "ectier.mover", "ectier.moves", "ectier.moves.*")),
    # "ectier" is the package facade, __init__.py; ectier.testing (and testing_*) wrap the facade for tests
    Layer("cache", 4, ("ectier.cache", "ectier.cache_arena", "ectier", "ectier.testing", "ectier.testing_order",
                       "ectier.testing_internals", "ectier.testing_remote")),
    Layer(
        "frontends",
        5,
        ("ectier.cli", "ectier.commands", "ectier.commands.*", "ectier.demo", "ectier.demo_workload", "ectier.demo_encoder", "ectier.demo_baseline",
         "ectier.demo_replay", "ectier.demo_report", "ectier.fsck", "ectier.fsck_pages", "ectier.fsck_segment", "ectier.__main__", "ectier.daemon",
         "ectier.daemon.*", "ectier.testing_daemon",
         "ectier.bench", "ectier.bench.*"),
    ),
)


# ------------------------------------------------------------------------------- the checker


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_package(path: pathlib.Path) -> bool:
    return path.name == "__init__.py"


def layer_of(module: str, layers=LAYERS) -> list[Layer]:
    return [layer for layer in layers if any(fnmatch.fnmatchcase(module, p) for p in layer.modules)]


def imported_names(source: str, module: str, package: bool, known: set[str]) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of everything ``source`` imports, ectier names resolved to modules."""
    tree = ast.parse(source)
    pkg_parts = module.split(".") if package else module.split(".")[:-1]
    out: list[tuple[int, str]] = []

    def resolve_ectier(base: str, names: list[str]) -> list[str]:
        got = []
        for n in names:
            if n != "*" and f"{base}.{n}" in known:
                got.append(f"{base}.{n}")  # from ectier import codec  -> ectier.codec
            else:
                got.append(base)  # from ectier.codec import pack_header -> ectier.codec
        return got

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append((node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 > len(pkg_parts) - 1:
                    out.append((node.lineno, "<relative import above the ectier package>"))
                    continue
                base_parts = pkg_parts[: len(pkg_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names = [a.name for a in node.names]
            if base == "ectier" or base.startswith("ectier."):
                out.extend((node.lineno, n) for n in resolve_ectier(base, names))
            else:
                out.append((node.lineno, base))
        elif isinstance(node, ast.Call):
            func = node.func
            dynamic = (isinstance(func, ast.Name) and func.id == "__import__") or (
                isinstance(func, ast.Attribute) and func.attr == "import_module"
            )
            if dynamic and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                out.append((node.lineno, node.args[0].value))
    return out


def violations(
    module: str, source: str, package: bool, known: set[str], layers=LAYERS
) -> list[str]:
    """Human-readable rule violations of one module (empty when it is clean)."""
    (own,) = layer_of(module, layers)
    problems = []
    for line, name in imported_names(source, module, package, known):
        top = name.split(".")[0]
        where = f"{module}:{line} imports {name}"
        if top in EVERYWHERE_FORBIDDEN:
            problems.append(f"{where}: nothing in ectier may import the vLLM binding")
        elif top in own.forbidden_external:
            problems.append(f"{where}: layer {own.name!r} must not import {top}")
        elif top == "ectier":
            target = layer_of(name, layers)
            if name not in known:
                problems.append(f"{where}: no such ectier module")
            elif not target:
                problems.append(f"{where}: {name} has no layer")
            elif target[0].rank > own.rank:
                problems.append(
                    f"{where}: layer {own.name!r} (rank {own.rank}) may not import layer "
                    f"{target[0].name!r} (rank {target[0].rank}); imports point down only"
                )
        elif name.startswith("<"):
            problems.append(f"{where}")
    return problems


def package_modules() -> dict[str, pathlib.Path]:
    return {
        module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts
    }


MODULES = package_modules()
#: importable names: every module, plus every package directory (also those without __init__.py)
KNOWN = set(MODULES) | {
    module_name(d / "__init__.py") for d in PACKAGE.rglob("*") if d.is_dir() and "__pycache__" not in d.parts
}


# ---------------------------------------------------------------------------------- the rules


def test_table_is_well_formed():
    ranks = [layer.rank for layer in LAYERS]
    assert ranks == sorted(ranks) and len(set(l.name for l in LAYERS)) == len(LAYERS)
    patterns = [p for layer in LAYERS for p in layer.modules]
    assert len(patterns) == len(set(patterns)), "a module pattern is listed twice"


def test_package_directories_are_known_even_without_init():
    for d in PACKAGE.rglob("*"):
        if d.is_dir() and "__pycache__" not in d.parts:
            assert module_name(d / "__init__.py") in KNOWN


def test_the_package_has_the_expected_core_modules():
    for name in ("ectier", "ectier.errors", "ectier.config", "ectier.arena", "ectier.index", "ectier.cache"):
        assert name in KNOWN


def test_every_module_has_a_layer():
    missing = [m for m in MODULES if not layer_of(m)]
    assert not missing, (
        f"modules in no layer: {missing}; add each to LAYERS in tests/test_layering.py "
        "(where does it sit in docs/architecture.md's layers?)"
    )
    ambiguous = {m: [l.name for l in layer_of(m)] for m in MODULES if len(layer_of(m)) > 1}
    assert not ambiguous, f"modules in several layers: {ambiguous}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    if not layer_of(module):
        pytest.skip("no layer (reported by test_every_module_has_a_layer)")
    path = MODULES[module]
    problems = violations(module, path.read_text(encoding="utf-8"), is_package(path), KNOWN)
    assert not problems, "\n".join(problems)


def test_pure_modules_named_in_the_brief_are_in_the_pure_layers():
    pure = {"ectier.errors", "ectier.config", "ectier.entry", "ectier.policy", "ectier.arena",
            "ectier.index", "ectier.codec", "ectier.sizing"}
    for m in pure:
        (layer,) = layer_of(m)
        assert layer.rank <= 1 and "torch" in layer.forbidden_external and "lmdb" in layer.forbidden_external


# ----------------------------------------------------- the checker catches what it should

FAKE_KNOWN = KNOWN | {"ectier.daemon", "ectier.daemon.server", "ectier.cli", "ectier.demo", "ectier.tiers.gpu"}


@pytest.mark.parametrize(
    "module, package, source, expect",
    [
        ("ectier.arena", False, "import torch\n", "must not import torch"),
        ("ectier.arena", False, "import torch.nn.functional as F\n", "must not import torch"),
        ("ectier.index", False, "from torch import Tensor\n", "must not import torch"),
        ("ectier.codec", False, "def f():\n    import lmdb\n", "must not import lmdb"),
        ("ectier.entry", False, "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n", "torch"),
        ("ectier.policy", False, "from .tensors import byte_view\n", "'tensors-and-tiers'"),
        ("ectier.policy", False, "from . import cache\n", "'cache'"),
        ("ectier.config", False, "from ectier.tiers.host import HostTier\n", "'tensors-and-tiers'"),
        ("ectier.config", False, "import ectier.cli\n", "'frontends'"),
        ("ectier.config", False, "from ectier import TieredCache\n", "'cache'"),  # the facade
        ("ectier.config", False, "import ectier\n", "'cache'"),
        ("ectier.sizing", False, "import importlib\nm = importlib.import_module('ectier.demo')\n", "'frontends'"),
        ("ectier.sizing", False, "t = __import__('torch')\n", "must not import torch"),
        ("ectier.tiers.host", False, "from ..cache import TieredCache\n", "'cache'"),
        ("ectier.tiers.host", False, "from ..daemon import server\n", "'frontends'"),
        ("ectier.tiers", True, "from .. import cli\n", "'frontends'"),
        ("ectier.tensors", False, "from .demo import main\n", "'frontends'"),
        ("ectier.cache", False, "from .daemon.server import serve\n", "'frontends'"),
        ("ectier.cache", False, "from .cli import main\n", "'frontends'"),
        ("ectier.cache", False, "import ectier_vllm\n", "vLLM binding"),
        ("ectier.cli", False, "from bindings.ectier_vllm import connector\n", "vLLM binding"),
        ("ectier.arena", False, "from .nosuchmodule import x\n", "no such ectier module"),
        ("ectier.arena", False, "from ... import x\n", "above the ectier package"),
    ],
)
def test_checker_flags_violations(module, package, source, expect):
    problems = violations(module, source, package, FAKE_KNOWN)
    assert problems, f"{source!r} in {module} should be refused"
    assert any(expect in p for p in problems), problems


@pytest.mark.parametrize(
    "module, package, source",
    [
        ("ectier.index", False, "from .arena import BlockAllocator\nfrom .entry import EntryMeta\n"),
        ("ectier.config", False, "def f():\n    from . import codec\n    import yaml\n"),
        ("ectier.codec", False, "import numpy as np\nimport zstandard\nfrom ectier.errors import ConfigError\n"),
        ("ectier.tiers.nvme", False, "import lmdb\nimport torch\nfrom ..codec import pack_header\nfrom ..tensors import byte_view\n"),
        ("ectier.tiers", True, "from .host import HostTier\nfrom . import nvme\n"),
        ("ectier.cache", False, "import torch\nfrom .tiers.host import HostTier\nfrom .index import Slot\n"),
        ("ectier", True, "from .cache import TieredCache\nfrom .config import CacheConfig\n"),
        ("ectier.cli", False, "from ectier import TieredCache\nfrom .daemon import server\n"),
        ("ectier.daemon.server", False, "from ..cache import TieredCache\nfrom . import server\n"),
    ],
)
def test_checker_allows_downward_imports(module, package, source):
    assert violations(module, source, package, FAKE_KNOWN) == []


def test_relative_import_resolution():
    got = imported_names("from ..config import X\nfrom . import nvme\nfrom .. import entry\n",
                         "ectier.tiers.host", False, FAKE_KNOWN)
    assert [n for _, n in got] == ["ectier.config", "ectier.tiers.nvme", "ectier.entry"]
    got = imported_names("from . import host\nfrom .host import HostTier\n", "ectier.tiers", True, FAKE_KNOWN)
    assert [n for _, n in got] == ["ectier.tiers.host", "ectier.tiers.host"]
    got = imported_names("from ectier import codec, TieredCache\n", "ectier.cli", False, FAKE_KNOWN)
    assert [n for _, n in got] == ["ectier.codec", "ectier"]


def test_unlayered_module_is_reported(tmp_path):
    pkg = tmp_path / "ectier"
    (pkg / "tiers").mkdir(parents=True)
    for rel in ("__init__.py", "errors.py", "tiers/__init__.py", "tiers/host.py", "shiny.py"):
        (pkg / rel).write_text("")
    names = {module_name(p, tmp_path) for p in pkg.rglob("*.py")}
    assert names == {"ectier", "ectier.errors", "ectier.tiers", "ectier.tiers.host", "ectier.shiny"}
    assert [m for m in sorted(names) if not layer_of(m)] == ["ectier.shiny"]
