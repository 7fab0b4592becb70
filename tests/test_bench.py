"""Smoke tests of every ``ectier bench`` subcommand (tiny sizes): replay, baseline, tiers and
crossover, their output files and tables. Usage errors: test_bench_errors.py; the harness pieces
(cost models, workloads, crossover, noise detection): test_bench_harness.py."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from ectier.cli import main


SMALL = ["--requests", "40", "--items", "12", "--max-tokens", "256", "-q", "--cost-model", "fitted"]


def _run(args, tmp_path):
    res = CliRunner().invoke(main, ["bench", *args, "--out", str(tmp_path)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


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


def test_bench_replay_gives_the_same_decisions_for_the_same_seed(tmp_path):
    """Two replays of one seed count the same hits per tier and refuse no put (no background
    write-behind taking NVMe budget at moments that vary between runs)."""
    runs = []
    for i in range(2):
        d = tmp_path / str(i)
        d.mkdir()
        _run(["replay", "--items", "20", "--requests", "100", "--no-curve", "--width-scale", "8", "-q"], d)
        runs.append([(r["policy"], r["host_hits"], r["nvme_hits"], r["misses"], r["put_refused"])
                     for r in json.loads((d / "replay.json").read_text())["runs"]])
    assert runs[0] == runs[1]
    assert all(r[-1] == 0 for r in runs[0]), runs[0]


def test_bench_replay_trace(tmp_path):
    tr = tmp_path / "t.csv"
    tr.write_text("timestamp,mm_hash,tokens\n" + "".join(f"{i},k{i % 5},{64 * (1 + i % 5)}\n" for i in range(30)))
    _run(["replay", "--trace", str(tr), "--no-curve", "--policy", "gdsf", "-q", "--cost-model", "fitted",
          "--host-bytes", "64MiB", "--nvme-bytes", "64MiB"], tmp_path)
    data = json.loads((tmp_path / "replay.json").read_text())
    (r,) = data["runs"]
    _check_run(r)
    assert r["hits"] == 25  # 5 distinct keys, every repeat hits at the default budgets


def test_bench_replay_says_how_long_the_whole_command_took_plot_included(tmp_path, monkeypatch):
    """The last line's seconds run to the last file written: a plot that takes 100 s (a clock
    moved on by it) shows. Before, they stopped before the plot (and after the imports)."""
    import time

    from ectier.bench import report

    real, skipped = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + skipped[0])

    def slow_plot(points, path, subtitle=""):
        skipped[0] += 100.0
        open(path, "wb").close()

    monkeypatch.setattr(report, "plot_curve", slow_plot)
    out = _run(["replay", *SMALL, "--curve-scale", "64"], tmp_path)
    (last,) = [line for line in out.splitlines() if line.startswith("wrote ")]
    assert "replay_curve.png" in last
    assert 100.0 <= float(last.rsplit(" in ", 1)[1].removesuffix(" s")) < 200.0, last
    assert json.loads((tmp_path / "replay.json").read_text())["elapsed_s"] < 100.0  # the results, before the plot


def test_bench_replay_no_curve_says_which_png_it_skips(tmp_path):
    out = _run(["replay", *SMALL, "--no-curve"], tmp_path)
    notes = [line for line in out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "replay_curve.png" in notes[0] and "--no-curve" in notes[0], out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replay.json", "replay.md"]


def test_bench_replay_width_scale_divides_both_budgets_and_says_so(tmp_path):
    out = _run(["replay", *SMALL, "--no-curve", "--width-scale", "8", "--host-bytes", "8MiB", "--nvme-bytes",
                "16MiB"], tmp_path)
    data = json.loads((tmp_path / "replay.json").read_text())
    for r in data["runs"]:
        _check_run(r)
        assert (r["host_bytes"], r["nvme_bytes"]) == (8 << 20, 16 << 20)  # as given: full width
        assert (r["held_host_bytes"], r["held_nvme_bytes"]) == (1 << 20, 2 << 20)  # what the cache had
    assert data["width_scale"] == 8
    assert "scaled 1/8 in width, budgets alike: the cache held host 1.0 MiB, NVMe 2.0 MiB" in " ".join(out.split())


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


def test_bench_tiers_and_crossover_smoke(tmp_path):
    out = _run(["tiers", "--tokens", "64,128", "--budget-bytes", "4MiB", "-q", "--no-sync", "--retries", "1"], tmp_path)
    assert "tiers" in out
    data = json.loads((tmp_path / "tiers.json").read_text())
    impls = {(r["tier"], r["op"], r["impl"]) for r in data["rows"]}
    assert {("host", "get", "ectier"), ("host", "get", "reference"), ("nvme", "put", "ectier"),
            ("nvme", "get", "reference")} <= impls
    assert all(r["p50_s"] > 0 and r["p99_s"] >= r["p50_s"] for r in data["rows"])
    assert all(isinstance(r["noisy"], bool) and 1 <= r["attempts"] <= 2 and "reasons" in r["noise"] for r in data["rows"])
    assert data["noise"]["retries"] == 1
    assert data["noise"]["noisy_rows"] == sum(r["noisy"] for r in data["rows"]) and data["noise"]["thresholds"]
    assert "noise" in out  # the table's column
    import torch

    assert any(s["what"] == "gpu rows" for s in data["skipped"]) != torch.cuda.is_available()
    out = _run(["crossover", "--tiers-json", str(tmp_path / "tiers.json"), "-q", "--cost-model", "fitted"], tmp_path)
    assert "crossover" in out
    cross = json.loads((tmp_path / "crossover.json").read_text())["tiers"]
    assert {"host", "nvme"} <= set(cross)


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


def test_replay_tables_fit_the_columns_the_user_asked_for(tmp_path, monkeypatch):
    """COLUMNS=80 with piped output: every printed line fits 80 characters (it used to be a fixed
    160 for non-terminals, whatever COLUMNS said)."""
    monkeypatch.setenv("COLUMNS", "80")
    res = CliRunner().invoke(main, ["bench", "replay", "--requests", "20", "--items", "10", "--no-curve",
                                    "--out", str(tmp_path)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    widest = max(len(line) for line in res.output.splitlines())
    assert widest <= 80, f"a line of {widest} characters"


def test_crossover_with_the_remote_store_down_writes_the_other_rows(tmp_path):
    """Nothing listens at remote.addresses: one line naming the store, the remote row marked
    unreachable, the host/NVMe rows still written (no traceback)."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # a port nothing listens on
    cfg = tmp_path / "remote.yaml"
    cfg.write_text(f"remote:\n  backend: redis\n  addresses: 127.0.0.1:{port}\n  timeout_s: 0.2\n  backoff_s: 0.2\n")
    _run(["tiers", "--tokens", "64", "--budget-bytes", "2MiB", "-q", "--no-sync", "--retries", "1"], tmp_path)
    out = _run(["crossover", "--tiers-json", str(tmp_path / "tiers.json"), "--tokens", "64", "--budget-bytes", "2MiB",
                "-q", "--cost-model", "fitted", "--remote-config", str(cfg)], tmp_path)
    assert f"127.0.0.1:{port}" in out and "unreachable" in out
    result = json.loads((tmp_path / "crossover.json").read_text())
    assert {"host", "nvme"} <= set(result["tiers"]) and "remote" not in result["tiers"]
    assert any(s["what"] == "remote rows" and str(port) in s["reason"] for s in result["skipped"])
    assert "unreachable" in (tmp_path / "crossover.md").read_text()
