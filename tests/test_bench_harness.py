"""The pieces of the ``ectier bench`` harness: cost models (fitted, measured, scaled), the workload
generator and traces, the like-with-like comparison, the crossover, tables wider than the console,
and noise detection (flagged measurements, repeats, the CPU probe)."""

from __future__ import annotations

import pytest

from ectier.bench.costmodel import fitted_cost_model, measured_cost_model, resolve_cost_model
from ectier.bench.crossover import crossover
from ectier.bench.workload import WorkloadSpec, generate, read_trace, stream_summary


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


@pytest.mark.parametrize(
    "text, column",
    [
        ("timestamp,mm_hash,width,height\n0,a,abc,100\n", "width"),
        ("timestamp,mm_hash,width,height\n0,a,100,\n", "height"),
        ("timestamp,mm_hash,tokens\n0,a,1.5\n", "tokens"),
        ("timestamp,mm_hash,tokens\nsoon,a,64\n", "timestamp"),
        ("timestamp,mm_hash,tokens\nnan,a,64\n", "timestamp"),
        ("timestamp,mm_hash,tokens\n0,a,64\ninf,b,64\n", "timestamp"),
    ],
)
def test_a_bad_trace_value_names_its_line_and_column(tmp_path, text, column):
    from ectier.errors import ConfigError

    trace = tmp_path / "t.csv"
    trace.write_text(text)
    with pytest.raises(ConfigError, match=rf"line \d+: {column}: expected"):
        read_trace(trace)


def test_the_safetensors_baseline_reads_a_hit_as_ectier_does_into_a_reused_buffer(tmp_path, monkeypatch):
    """Same work on both sides of `bench baseline`: ectier's replay reads a hit with get(out=) into a
    reused buffer, so the baseline must not time a fresh owned copy (materialize: a clone, whose new
    tensor pays its page faults) against it; its bytes are still all read and checked."""
    from ectier.bench.baseline import replay_safetensors
    from ectier.bench.workload import Request
    from ectier.demo_baseline import SafetensorsPerItemStore

    asked, real_load = [], SafetensorsPerItemStore.load

    def load(self, mm_hash, *, materialize=True):
        asked.append(materialize)
        return real_load(self, mm_hash, materialize=materialize)

    monkeypatch.setattr(SafetensorsPerItemStore, "load", load)
    stream = [Request(f"img{i % 2}", 3 + i % 2, (3 + i % 2) * 64 * 2, "photo", 0, 0, float(i)) for i in range(6)]
    r = replay_safetensors(stream, fitted_cost_model(), width=64, workdir=str(tmp_path))
    assert (r["hits"], r["misses"], r["mismatches"]) == (4, 2, 0)
    assert asked == [False] * 4
