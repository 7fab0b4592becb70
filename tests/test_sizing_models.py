"""Tests for ectier.models and ectier.sizing's front door: the model registry (aliases, unknown
names, registering a ModelSpec, its validation), ``parse_size``, and that both modules import only
the standard library and ectier (no torch). Token math: test_sizing.py."""

from __future__ import annotations

import ast
import pathlib

import pytest

from ectier import models, sizing, testing_internals
from ectier.errors import ConfigError
from ectier.sizing import MODELS, ModelSpec, get_model, image_tokens, max_tokens, min_tokens, parse_size, register_model


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "alias",
    ["qwen3-vl", "qwen3_vl", "qwen3_vl_moe", "Qwen/Qwen3-VL-30B-A3B-Instruct", "QWEN3-VL", " qwen3-vl "],
)
def test_qwen3_vl_aliases(alias):
    assert get_model(alias).name == "qwen3-vl"
    assert image_tokens(1920, 1080, model=alias).nbytes == 33_423_360


def test_unknown_model_error_names_argument_and_lists_models():
    with pytest.raises(ConfigError) as excinfo:
        get_model("llava-9000")
    msg = str(excinfo.value)
    assert "model" in msg
    assert "'llava-9000'" in msg
    assert "qwen3-vl" in msg
    assert "gemma3" in msg
    with pytest.raises(ValueError, match="llava-9000"):
        image_tokens(10, 10, model="llava-9000")
    with pytest.raises(ConfigError, match="model"):
        get_model(42)


def test_models_is_read_only_view():
    assert set(MODELS) >= {"qwen3-vl", "gemma3"}
    assert MODELS["gemma3"].embed_dim == 5376
    with pytest.raises(TypeError):
        MODELS["x"] = MODELS["gemma3"]  # type: ignore[index]
    with pytest.raises(TypeError):
        del MODELS["gemma3"]  # type: ignore[attr-defined]


def test_model_spec_is_frozen():
    spec = get_model("qwen3-vl")
    with pytest.raises(AttributeError):
        spec.embed_dim = 1  # type: ignore[misc]


def test_register_model_and_use_it():
    spec = ModelSpec(
        name="test-fixed-tiny",
        aliases=("org/test-fixed-tiny",),
        embed_dim=100,
        dtype="float32",
        fixed_tokens=7,
    )
    with testing_internals.isolated_model_registry():
        assert register_model(spec) is spec
        assert spec.itemsize == 4  # derived from float32
        assert MODELS["test-fixed-tiny"] is spec
        assert get_model("ORG/test-fixed-tiny") is spec
        assert image_tokens(10, 10, model="org/test-fixed-tiny").nbytes == 7 * 100 * 4
        with pytest.raises(ConfigError, match="already"):
            register_model(spec)
        clash = ModelSpec(name="other", aliases=("qwen3_vl",), embed_dim=1, dtype="bfloat16", fixed_tokens=1)
        with pytest.raises(ConfigError, match="qwen3_vl"):
            register_model(clash)
        assert "other" not in MODELS


def test_unregistered_spec_can_be_passed_directly():
    spec = ModelSpec(
        name="qwen2-vl-like",
        embed_dim=3584,
        dtype="bfloat16",
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=3136,
        max_pixels=12845056,
    )
    # 504 x 1008 (see test_smart_resize_other_factor): grid 36 x 72, 2592 patches, N = 648.
    t = image_tokens(1000, 500, model=spec)
    assert (t.resized_width, t.resized_height) == (1008, 504)
    assert (t.grid_h, t.grid_w) == (36, 72)
    assert t.num_patches == 2592
    assert t.num_tokens == 648
    assert t.nbytes == 648 * 3584 * 2
    assert min_tokens(spec) == 4  # 3136 / 28**2
    assert max_tokens(spec) == 16384  # 12845056 / 28**2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fixed_tokens": 4, "patch_size": 16}, "not both"),
        ({"patch_size": 16}, "missing"),
        ({}, "missing"),
        ({"fixed_tokens": 0}, "fixed_tokens"),
        ({"fixed_tokens": 4, "itemsize": 4}, "itemsize"),
        ({"fixed_tokens": 4, "dtype": "weird"}, "itemsize"),
        ({"fixed_tokens": 4, "embed_dim": 0}, "embed_dim"),
        ({"fixed_tokens": 4, "name": ""}, "name"),
        ({"fixed_tokens": 4, "aliases": "single"}, "aliases"),
    ],
)
def test_model_spec_validation(kwargs, match):
    base = {"name": "x", "embed_dim": 8, "dtype": "bfloat16"}
    base.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        ModelSpec(**base)


def test_register_model_rejects_non_spec():
    with pytest.raises(ConfigError, match="spec"):
        register_model({"name": "x"})  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# parse_size
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1920x1080", (1920, 1080)),
        ("1920X1080", (1920, 1080)),
        ("1920×1080", (1920, 1080)),
        ("1920,1080", (1920, 1080)),
        (" 640 x 480 ", (640, 480)),
        ("1x200", (1, 200)),
    ],
)
def test_parse_size_good(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", "1920", "1920x", "x1080", "1920x1080x3", "1920*1080", "-1x5", "1.5x2", "0x10", "10x0", "abc", "1920 1080"],
)
def test_parse_size_bad(text):
    with pytest.raises(ConfigError) as excinfo:
        parse_size(text)
    assert repr(text) in str(excinfo.value)


def test_parse_size_rejects_non_str():
    with pytest.raises(ConfigError, match="size"):
        parse_size((1920, 1080))  # type: ignore[arg-type]


def test_parse_size_feeds_image_tokens_width_first():
    assert image_tokens(*parse_size("1920x1080")).resized_height == 1088


# --------------------------------------------------------------------------------------------
# No torch
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [sizing, models], ids=["sizing", "models"])
def test_sizing_and_models_import_only_stdlib_and_ectier(module):
    source = pathlib.Path(module.__file__).read_text(encoding="utf-8")
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    assert "torch" not in roots
    assert "numpy" not in roots
    allowed = {"__future__", "ast", "dataclasses", "math", "numbers", "re", "threading", "types", "typing", "ectier"}
    assert roots <= allowed, roots - allowed


def test_models_does_not_import_the_token_math():
    # The token math imports the registry, never the other way round (no import cycle).
    imported = set()
    for node in ast.walk(ast.parse(pathlib.Path(models.__file__).read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            imported.add(("." * node.level) + (node.module or ""))
            imported.update(f"{node.module}.{a.name}" for a in node.names if node.module == "ectier")
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert not {".sizing", "ectier.sizing"} & imported, imported


def test_sizing_still_exports_every_registry_name():
    # Callers that import models from ectier.sizing (cli, demo, bench) keep working.
    for name in models.__all__:
        assert getattr(sizing, name) is getattr(models, name), name
    assert set(models.__all__) - {"GEMMA3", "QWEN3_VL"} <= set(sizing.__all__)
