"""Static checks of the package's code: no name used that is never defined (pyflakes). A merge
that drops an import leaves code that fails only on the path using it (a ``NameError`` on a rare
branch), so this runs over every module of ``ectier/``, ``bindings/`` and ``tools/``."""

from __future__ import annotations

import pathlib

import pytest
from pyflakes import api, messages, reporter

REPO = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("ectier", "bindings", "tools") for p in (REPO / d).rglob("*.py"))
FATAL = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


class _Collect(reporter.Reporter):
    def __init__(self) -> None:
        self.found: list[str] = []

    def flake(self, message) -> None:
        if isinstance(message, FATAL):
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text) -> None:  # noqa: N802 - pyflakes API
        self.found.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg) -> None:  # noqa: N802 - pyflakes API
        self.found.append(f"{filename}: {msg}")


def test_the_sources_are_found():
    assert len(SOURCES) > 50 and any(p.name == "cache.py" for p in SOURCES)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_undefined_names(path):
    rep = _Collect()
    api.checkPath(str(path), rep)
    assert rep.found == []
