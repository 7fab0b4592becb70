"""Smoke tests of every ``ectier bench`` subcommand (tiny sizes) and of the harness pieces."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from ectier.bench.costmodel import fitted_cost_model, measured_cost_model, resolve_cost_model
from ectier.bench.crossover import crossover
from ectier.bench.workload import WorkloadSpec, generate, read_trace, stream_summary
from ectier.cli import main

SMALL = ["--requests", "40", "--items", "12", "--max-tokens", "256", "-q", "--cost-model", "fitted"]


def _run(args, tmp_path):
    res = CliRunner().invoke(main, ["bench", *args, "--out", str(tmp_path)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


def test_cost_model_fits_background_points():
    m = fitted_cost_model()
    assert m.seconds(256) == pytest.approx(0.019) and m.seconds(1024) == pytest.approx(0.025)
    assert m.seconds(16384) > m.seconds(1024) and "background.md" in m.description
    assert resolve_cost_model("auto").source in ("fitted", "measured")
    with pytest.raises(ValueError):
        resolve_cost_model("guess")


def test_measured_cost_model_tiny_tower_on_cpu():
    m = measured_cost_model("cpu", (4, 8), depth=1, repeats=1)
    assert m.source == "measured" and "measured on cpu" in m.description and m.seconds(8) > 0


def test_workload_generator_and_trace(tmp_path):
    s = generate(WorkloadSpec(requests=200, items=30, seed=1))
    assert len(s) == 200 and s == generate(WorkloadSpec(requests=200, items=30, seed=1))
    summ = stream_summary(s)
    assert summ["unique_items"] < 200 and 64 <= summ["tokens_min"] <= summ["tokens_max"] <= 16384
    wh = tmp_path / "wh.csv"
    wh.write_text("timestamp,mm_hash,width,height\n2,b,1920,1080\n1,a,256,256\n")
    assert [(r.mm_hash, r.num_tokens) for r in read_trace(wh)] == [("a", 64), ("b", 2040)]
    tk = tmp_path / "tk.csv"
    tk.write_text("timestamp,mm_hash,tokens\n0,a,100\n")
    assert read_trace(tk)[0].nbytes == 100 * 8192 * 2
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp,key\n0,a\n")
    from ectier.errors import ConfigError

    with pytest.raises(ConfigError, match="columns"):
        read_trace(bad)
    clash = tmp_path / "clash.csv"
    clash.write_text("timestamp,mm_hash,tokens\n0,a,100\n1,a,200\n")
    with pytest.raises(ConfigError, match="appears with"):
        read_trace(clash)


def _check_run(r):
    for k in ("hit_rate", "host_hit_rate", "nvme_hit_rate", "byte_hit_rate", "saved_fraction"):
        assert 0.0 <= r[k] <= 1.0, (k, r[k])
    assert r["encoder_saved_s"] >= 0 and r["mismatches"] == 0
    assert r["hits"] + r["misses"] == r["requests"]
    assert r["host_hits"] + r["nvme_hits"] == r["hits"]


def test_bench_replay_smoke(tmp_path):
    out = _run(["replay", *SMALL, "--curve-scale", "64"], tmp_path)
    assert "replay:" in out and "hit rate vs capacity" in out and "GDSF vs LRU" in out
    data = json.loads((tmp_path / "replay.json").read_text())
    assert {r["policy"] for r in data["runs"]} == {"lru", "gdsf"}
    for r in data["runs"]:
        _check_run(r)
    assert len(data["curve"]) == 10 and data["cost_model"]["source"] == "fitted"
    assert (tmp_path / "replay_curve.png").stat().st_size > 0 and (tmp_path / "replay.md").exists()


def test_bench_replay_trace(tmp_path):
    tr = tmp_path / "t.csv"
    tr.write_text("timestamp,mm_hash,tokens\n" + "".join(f"{i},k{i % 5},{64 * (1 + i % 5)}\n" for i in range(30)))
    _run(["replay", "--trace", str(tr), "--no-curve", "--policy", "gdsf", "-q", "--cost-model", "fitted",
          "--host-bytes", "64MiB", "--nvme-bytes", "64MiB"], tmp_path)
    data = json.loads((tmp_path / "replay.json").read_text())
    (r,) = data["runs"]
    _check_run(r)
    assert r["hits"] == 25  # 5 distinct keys, every repeat hits at the default budgets


def test_bench_replay_bad_policy(tmp_path):
    res = CliRunner().invoke(main, ["bench", "replay", "--policy", "fifo", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "policy" in res.output


def test_bench_baseline_smoke(tmp_path):
    out = _run(["baseline", *SMALL], tmp_path)
    assert "safetensors" in out and "recompute" in out
    data = json.loads((tmp_path / "baseline.json").read_text())
    assert len(data["stores"]) == 4
    for s in data["stores"]:
        assert 0 <= s["hit_rate"] <= 1 and s["encoder_saved_s"] >= 0
    assert data["stores"][0]["ratio_vs_recompute"] == pytest.approx(1.0)
    # H200-fitted encoder seconds vs cache I/O measured here: the output says it mixes two machines
    assert "NOT like with like" in out and data["comparison"]["like_with_like"] is False
    assert (tmp_path / "baseline.png").stat().st_size > 0


def test_bench_baseline_default_compares_like_with_like(tmp_path):
    """Without --cost-model the encoder is timed on this machine (CPU: one block, scaled), as the I/O is."""
    out = _run(["baseline", *[a for a in SMALL if a not in ("--cost-model", "fitted")]], tmp_path)
    data = json.loads((tmp_path / "baseline.json").read_text())
    assert data["cost_model"]["source"] in ("scaled", "measured")
    assert data["comparison"]["like_with_like"] is True
    assert "like with like" in out and "NOT like with like" not in out
    assert (tmp_path / "baseline.png").stat().st_size > 0
    stores = data["stores"]
    assert stores[0]["ratio_vs_recompute"] == 1.0
    assert all(s["encoder_plus_io_s"] == pytest.approx(s["encoder_spent_s"] + s["get_s"] + s["put_s"]) for s in stores)


def test_compare_stores_says_which_machine_the_encoder_seconds_come_from():
    from ectier.bench.baseline import compare_stores
    from ectier.bench.costmodel import CostModel

    def rows():
        return [{"encoder_total_s": 10.0, "encoder_spent_s": 10.0, "get_s": 0.0, "put_s": 0.0},
                {"encoder_total_s": 10.0, "encoder_spent_s": 4.0, "get_s": 1.0, "put_s": 0.5}]

    here = CostModel(0.1, 1e-3, 0.0, "scaled", "timed here")
    for cost, like in ((fitted_cost_model(), False), (here, True), (CostModel(0, 0, 0, "measured", "cuda"), True)):
        r = rows()
        c = compare_stores(r, cost)
        assert c["like_with_like"] is like and cost.on_this_machine is like
        assert ("NOT like with like" in c["text"]) is not like and cost.description in c["text"]
        assert r[1]["ratio_vs_recompute"] == pytest.approx(0.55)


def test_scaled_cost_model_times_one_block_here_and_scales_by_flops():
    from ectier.bench.costmodel import scaled_cost_model, tower_flop_terms

    m = scaled_cost_model((2, 4), blocks=1)
    assert m.source == "scaled" and m.on_this_machine and "1 of 27" in m.description
    assert m.a_s >= 0 and m.b_s_per_token > 0 and m.c_s_per_token2 > 0
    assert 0 < m.seconds(64) < m.seconds(1024) < m.seconds(16384)
    lin1, quad1 = tower_flop_terms(1)
    lin27, quad27 = tower_flop_terms(27)
    assert 15 * lin1 < lin27 < 27 * lin1 and quad27 == 27 * quad1  # 27 blocks (+3 mergers, 1 patch embed)
    assert m.c_s_per_token2 / m.b_s_per_token == pytest.approx(quad27 / lin27)
    with pytest.raises(ValueError, match="tokens"):
        scaled_cost_model((4,))
    with pytest.raises(ValueError, match="cpu_fallback"):
        resolve_cost_model("auto", cpu_fallback="guess")


def test_bench_tiers_and_crossover_smoke(tmp_path):
    out = _run(["tiers", "--tokens", "64,128", "--budget-bytes", "4MiB", "-q", "--no-sync"], tmp_path)
    assert "tiers" in out
    data = json.loads((tmp_path / "tiers.json").read_text())
    impls = {(r["tier"], r["op"], r["impl"]) for r in data["rows"]}
    assert {("host", "get", "ectier"), ("host", "get", "reference"), ("nvme", "put", "ectier"),
            ("nvme", "get", "reference")} <= impls
    assert all(r["p50_s"] > 0 and r["p99_s"] >= r["p50_s"] for r in data["rows"])
    import torch

    assert any(s["what"] == "gpu rows" for s in data["skipped"]) != torch.cuda.is_available()
    out = _run(["crossover", "--tiers-json", str(tmp_path / "tiers.json"), "-q", "--cost-model", "fitted"], tmp_path)
    assert "crossover" in out
    cross = json.loads((tmp_path / "crossover.json").read_text())["tiers"]
    assert {"host", "nvme"} <= set(cross)


def test_crossover_logic():
    m = fitted_cost_model()
    rows = [{"tier": "host", "op": "get", "impl": "ectier", "num_tokens": n, "p50_s": n * 1e-7} for n in (64, 1024)]
    rows += [{"tier": "nvme", "op": "get", "impl": "ectier", "num_tokens": n, "p50_s": n * 2e-5} for n in (64, 1024)]
    c = crossover(rows, m)
    assert c["host"]["crossover_tokens"] is None and "never" in c["host"]["verdict"]
    n = c["nvme"]["crossover_tokens"]
    assert n is not None and n * 2e-5 >= m.seconds(n) * 0.95


def test_bench_bad_inputs_fail_cleanly_before_running(tmp_path):
    from click.testing import CliRunner

    from ectier.cli import main as cli_main

    runner = CliRunner()
    r = runner.invoke(cli_main, ["bench", "replay", "-q", "--no-curve", "--requests", "5",
                                 "--host-bytes", "0", "--nvme-bytes", "0", "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "no tier could store anything" in r.output and r.exception is not None
    assert isinstance(r.exception, SystemExit)  # a clean CLI error, not a traceback
    r = runner.invoke(cli_main, ["bench", "replay", "-q", "--no-curve", "--requests", "5", "--out", "/dev/null/x"])
    assert r.exit_code == 2 and "--out" in r.output
    bogus = tmp_path / "bogus.json"
    bogus.write_text('{"x": 1}')
    r = runner.invoke(cli_main, ["bench", "crossover", "--tiers-json", str(bogus), "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "--tiers-json" in r.output


@pytest.mark.parametrize("tokens, says", [
    ("abc", "comma-separated whole numbers"),
    ("64,,1024", "comma-separated whole numbers"),
    ("0", "1..16384"),
    ("99999999", "1..16384"),
])
@pytest.mark.parametrize("command", ["tiers", "crossover"])
def test_bench_tokens_list_is_a_usage_error_not_a_traceback(tmp_path, command, tokens, says):
    res = CliRunner().invoke(main, ["bench", command, "-q", "--tokens", tokens, "--out", str(tmp_path)])
    assert res.exit_code == 2, res.output
    assert "--tokens" in res.output and says in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    assert not any(tmp_path.iterdir())  # nothing measured, nothing written


@pytest.mark.parametrize("args, written", [
    (["replay", *SMALL, "--curve-scale", "64"], ["replay.json", "replay.md"]),
    (["tiers", "--tokens", "64", "--budget-bytes", "2MiB", "-q", "--no-sync"], ["tiers.json", "tiers.md"]),
    (["crossover", "--tokens", "64", "--budget-bytes", "2MiB", "-q", "--cost-model", "fitted"],
     ["crossover.json", "crossover.md"]),
])
def test_bench_without_matplotlib_writes_results_and_one_note(tmp_path, monkeypatch, args, written):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ModuleNotFoundError
    res = CliRunner().invoke(main, ["bench", *args, "--out", str(tmp_path)])
    assert res.exit_code == 0 and res.exception is None, res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(written)  # results, no PNG
    json.loads((tmp_path / written[0]).read_text())
    notes = [line for line in res.output.splitlines() if "matplotlib is not installed" in line]
    assert len(notes) == 1 and "ectier[bench]" in notes[0]


def test_demo_sh_installs_what_the_readmes_bench_command_plots_with():
    """./scripts/demo.sh bootstraps the `demo` extra; README then runs `ectier bench replay` (PNG plots)."""
    import ast
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    assert re.search(r"bootstrap\.sh demo\b", (root / "scripts" / "demo.sh").read_text())
    assert "ectier bench replay" in (root / "README.md").read_text()
    call = next(n for n in ast.walk(ast.parse((root / "setup.py").read_text()))
                if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    extras = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))
    assert any(req.startswith("matplotlib") for req in extras["demo"])
