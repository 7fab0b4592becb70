"""Smoke tests of every ``ectier bench`` subcommand (tiny sizes) and of the harness pieces."""

from __future__ import annotations

import json
import os
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
    assert m.seconds(16384) > m.seconds(1024) and "docs/benchmarks.md" in m.description
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
    huge = tmp_path / "huge.csv"
    huge.write_text("timestamp,mm_hash,tokens\n0,a,64\n1,b,16385\n")
    with pytest.raises(ConfigError, match=r"line 3: tokens must be in \[1, 16384\]"):
        read_trace(huge)
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"timestamp,mm_hash,tokens\n0,\xff\xfe,64\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_trace(binary)
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


@pytest.mark.parametrize("args, option", [
    (["--seed", "-1"], "--seed"),
    (["--requests", "100000000000"], "--requests"),
    (["--items", "100000000000"], "--items"),
    (["--trace", "BINARY"], "not UTF-8"),
    (["--trace", "HUGE"], "tokens must be in"),
    (["--host-bytes", "0", "--nvme-bytes", "0"], "both 0"),  # (named nvme.path, which bench has no option for)
    (["--host-bytes", "1"], "--host-bytes: 1 is less than one block"),  # (ran with a 1-byte host tier)
    (["--nvme-bytes", "100"], "--nvme-bytes: 100 bytes is below one 64 KiB block"),
])
def test_bench_replay_bad_stream_is_a_usage_error_not_a_traceback(tmp_path, args, option):
    (tmp_path / "b.csv").write_bytes(b"timestamp,mm_hash,tokens\n0,\xff\xfe,64\n")
    (tmp_path / "h.csv").write_text("timestamp,mm_hash,tokens\n0,a,99999999999999\n")
    args = [{"BINARY": str(tmp_path / "b.csv"), "HUGE": str(tmp_path / "h.csv")}.get(a, a) for a in args]
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["bench", "replay", "-q", "--no-curve", *args, "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert option in res.output and "Traceback" not in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    assert not out.exists() or not any(out.iterdir())  # nothing run, nothing written


@pytest.mark.parametrize("command", ["replay", "tiers", "baseline", "crossover", "connectors"])
def test_bench_workdir_where_nothing_can_be_made_is_a_usage_error(tmp_path, command):
    if not os.path.isdir("/proc"):
        pytest.skip("no /proc here")
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["bench", command, "-q", "--workdir", "/proc", "--out", str(out)])
    assert res.exit_code == 2 and "--workdir" in res.output and "cannot make" in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)  # (a traceback before)


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


@pytest.mark.parametrize("source, smallest", [("trace", 128), ("generator", 70)])
def test_bench_replay_refuses_a_max_tokens_that_leaves_no_image_up_front(tmp_path, source, smallest):
    if source == "trace":
        tr = tmp_path / "t.csv"
        tr.write_text("timestamp,mm_hash,tokens\n0,a,128\n1,b,1024\n2,a,128\n")
        args = ["--trace", str(tr)]
    else:
        args = ["--items", "2", "--requests", "5", "--seed", "0"]  # two images, neither <= 64 tokens
    res = CliRunner().invoke(main, ["bench", "replay", "-q", "--no-curve", *args, "--max-tokens", "64",
                                    "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output  # a usage error before any run, not a traceback after one
    assert "--max-tokens" in res.output and f"the smallest accepted value is {smallest}" in res.output
    assert not (tmp_path / "out" / "replay.json").exists()


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


def test_crossover_logic():
    m = fitted_cost_model()
    rows = [{"tier": "host", "op": "get", "impl": "ectier", "num_tokens": n, "p50_s": n * 1e-7} for n in (64, 1024)]
    rows += [{"tier": "nvme", "op": "get", "impl": "ectier", "num_tokens": n, "p50_s": n * 2e-5} for n in (64, 1024)]
    c = crossover(rows, m)
    assert c["host"]["crossover_tokens"] is None and "never" in c["host"]["verdict"]
    assert "load measured up to N = 1024, extrapolated above it" in c["host"]["verdict"]
    n = c["nvme"]["crossover_tokens"]
    assert n is not None and n * 2e-5 >= m.seconds(n) * 0.95
    assert ("extrapolated" in c["nvme"]["verdict"]) == (n > 1024)


def test_bench_bad_inputs_fail_cleanly_before_running(tmp_path):
    from click.testing import CliRunner

    from ectier.cli import main as cli_main

    runner = CliRunner()
    r = runner.invoke(cli_main, ["bench", "replay", "-q", "--no-curve", "--requests", "5",
                                 "--host-bytes", "0", "--nvme-bytes", "0", "--out", str(tmp_path / "o")])
    assert r.exit_code == 2 and "no tier could store anything" in r.output and r.exception is not None
    assert "--host-bytes" in r.output and "nvme.path" not in r.output  # the options given, not a config knob
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


# ============================================================================ noise detection


def test_assess_flags_spread_disturbed_median_other_load_and_physical_floor():
    from ectier.bench.noise import NoiseThresholds, assess

    quiet = assess([1e-3] * 9 + [1.1e-3], other_cpu=0.1)
    assert not quiet["noisy"] and quiet["reasons"] == [] and quiet["spread_p90_p50"] == pytest.approx(1.01)
    # the case: most repeats land on a 4 ms scheduler step, a clean one takes 0.05 ms
    stepped = assess([4e-3] * 8 + [0.05e-3, 8e-3])
    assert stepped["noisy"] and any("p50/min" in r for r in stepped["reasons"])
    spread = assess([1e-3] * 7 + [5e-3] * 3)
    assert spread["noisy"] and any("spread" in r for r in spread["reasons"])
    busy = assess([1e-3] * 10, other_cpu=0.8)
    assert busy["noisy"] and any("other processes" in r for r in busy["reasons"])
    assert not assess([1e-3] * 10, other_cpu=None)["noisy"]  # unknown load is not judged
    slow = assess([8e-3] * 10, max_p50_s=1e-3)  # 1 MiB memcpy at 0.13 GB/s
    assert slow["noisy"] and any("physical floor" in r for r in slow["reasons"])
    assert not assess([1e-3] * 7 + [5e-3] * 3, thresholds=NoiseThresholds(max_spread=10, max_p50_over_min=10))["noisy"]
    with pytest.raises(ValueError, match="times"):
        assess([])


def test_measure_until_quiet_repeats_a_noisy_measurement_and_flags_what_stays_noisy():
    from ectier.bench.noise import measure_until_quiet

    noisy, clean = [1e-3] * 5 + [9e-3] * 5, [2e-3] * 10
    attempts = iter([noisy, clean, noisy])
    times, noise = measure_until_quiet(lambda: next(attempts), retries=2)
    assert times == clean and noise["attempts"] == 2 and noise["noisy"] is False
    worse = [1e-3] * 5 + [9e-3] * 4 + [90e-3]
    attempts = iter([worse, noisy])
    times, noise = measure_until_quiet(lambda: next(attempts), retries=1, max_p50_s=4e-3)
    assert noise["attempts"] == 2 and noise["noisy"] is True and noise["reasons"]
    assert times == noisy  # fewer reasons than `worse` (whose p50 is past the floor too)
    times, noise = measure_until_quiet(lambda: list(noisy), retries=0)
    assert noise["attempts"] == 1 and noise["noisy"]
    with pytest.raises(ValueError, match="retries"):
        measure_until_quiet(lambda: clean, retries=-1)


def test_cpu_probe_counts_other_processes_only():
    from ectier.bench.noise import CpuProbe

    stats = iter([(100, 1000), (160, 1100)])  # 60 busy ticks of 100, all CPUs together
    own = iter([1.0, 1.2])  # this process used 0.2 s = 20 ticks of them
    p = CpuProbe(read_stat=lambda: next(stats), own_cpu_s=lambda: next(own), ticks_per_s=100)
    p.start()
    assert p.stop() == pytest.approx(0.4)
    stats = iter([(100, 1000), (101, 1002)])
    p = CpuProbe(read_stat=lambda: next(stats), own_cpu_s=lambda: 0.0, ticks_per_s=100)
    p.start()
    assert p.stop() is None  # 2 ticks: too short to tell
    p = CpuProbe(read_stat=lambda: None)
    p.start()
    assert p.stop() is None  # no /proc/stat
    real = CpuProbe(min_ticks=0)
    real.start()
    v = real.stop()
    assert v is None or 0.0 <= v <= 1.0


def _fake_clock(steps):
    """perf_counter stand-in: each call advances by the next of ``steps`` (cycled), in seconds."""
    state = {"t": 0.0, "i": 0}

    def clock():
        state["t"] += steps[state["i"] % len(steps)]
        state["i"] += 1
        return state["t"]

    return clock


def test_measure_tiers_repeats_and_flags_noisy_rows_with_an_injected_clock():
    from ectier.bench.noise import CpuProbe
    from ectier.bench.tiers import measure_tiers

    no_load = CpuProbe(read_stat=lambda: None)
    # each repeat is (end - start) = the second step of a pair: 1 ms and 10 ms alternate -> p50/min 5.5
    data = measure_tiers((64,), sync=False, budget_bytes=2 << 20, retries=1, clock=_fake_clock([0, 1e-3, 0, 10e-3]),
                         probe=no_load)
    rows = data["rows"]
    assert rows and all(r["noisy"] and r["attempts"] == 2 and r["noise"]["reasons"] for r in rows)
    assert data["noise"]["noisy_rows"] == len(rows) and data["noise"]["retries"] == 1
    quiet = measure_tiers((64,), sync=False, budget_bytes=2 << 20, clock=_fake_clock([0, 0.5e-3]), probe=no_load)
    assert not any(r["noisy"] for r in quiet["rows"]) and all(r["attempts"] == 1 for r in quiet["rows"])
    assert quiet["noise"]["noisy_rows"] == 0


def test_noise_summary_and_crossover_name_noisy_rows():
    from ectier.bench.noise import noise_summary

    def row(tier, n, noisy):
        return {"tier": tier, "op": "get", "impl": "ectier", "num_tokens": n, "p50_s": n * 2e-5, "noisy": noisy,
                "noise": {"reasons": ["p50/min 9.0 > 3"] if noisy else []}}

    clean = [row("nvme", 64, False), row("nvme", 1024, False)]
    assert noise_summary(clean) is None and "NOISY" not in crossover(clean, fitted_cost_model())["nvme"]["verdict"]
    assert noise_summary(clean, run_other_cpu=0.9).startswith("NOISY RUN")
    mixed = [row("nvme", 64, True), row("nvme", 1024, False)]
    text = noise_summary(mixed)
    assert text.startswith("NOISY RUN") and "nvme get ectier N=64" in text and "p50/min" in text
    c = crossover(mixed, fitted_cost_model())["nvme"]
    assert c["noisy_tokens"] == [64] and "NOISY" in c["verdict"]


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


def test_a_table_wider_than_the_console_is_turned_and_loses_no_digit():
    """``ectier bench replay`` in an 80-column terminal cut every number ("14…"): a table wider
    than the console is printed a row per column, every cell whole, within the width."""
    import io

    from rich.console import Console

    from ectier.bench.report import print_table

    headers = ["store", *[f"metric number {i}" for i in range(12)]]
    rows = [["lru", *[f"{1234.5678 * (i + 1):.4f} MiB" for i in range(12)]],
            ["gdsf", *[f"{8765.4321 * (i + 1):.4f} MiB" for i in range(12)]]]
    narrow = Console(width=80, record=True, file=io.StringIO())
    print_table(narrow, "a title", headers, rows)
    text = narrow.export_text()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    for cell in rows[0][1:] + rows[1][1:] + headers[1:]:
        assert cell in text, cell  # whole, on one line
    wide = Console(width=400, record=True, file=io.StringIO())
    print_table(wide, "a title", headers, rows)
    assert wide.export_text().splitlines()[4].count("│") == len(headers) + 1  # fits: as given
