"""Load or recompute (bindings/ectier_vllm/recompute.py): pure logic, no vLLM, no torch."""

from __future__ import annotations

import pytest

from ectier_vllm.recompute import EncoderCost, EncoderStepTimer, LoadOrRecompute, RecomputePolicy, TierBandwidth

MiB = 1 << 20
ROW = 8192 * 2  # bytes per token of an (N, 8192) bf16 entry


def _bw(**tiers: float) -> TierBandwidth:
    """Estimates after three reads per tier at exactly the given GB/s."""
    b = TierBandwidth(min_samples=3)
    for tier, gbps in tiers.items():
        for _ in range(3):
            b.observe(tier, 64 * MiB, 64 * MiB / (gbps * 1e9))
    return b


def test_ewma_moves_towards_new_reads_by_alpha():
    b = TierBandwidth(alpha=0.25, min_samples=1)
    b.observe("nvme", 1000, 1.0)  # 1000 B/s: first read sets it
    assert b.bytes_per_s("nvme") == pytest.approx(1000)
    b.observe("nvme", 5000, 1.0)
    assert b.bytes_per_s("nvme") == pytest.approx(0.75 * 1000 + 0.25 * 5000)
    assert b.snapshot()["nvme"] == {"bytes_per_s": pytest.approx(2000), "reads": 2}
    b.observe("nvme", 0, 1.0)  # empty, instant or nonsense reads are ignored
    b.observe("nvme", 10, 0.0)
    b.observe("nvme", 10, float("nan"))
    assert b.snapshot()["nvme"]["reads"] == 2


def test_unknown_until_min_samples():
    b = TierBandwidth(min_samples=3)
    b.observe("host", MiB, 0.001)
    b.observe("host", MiB, 0.001)
    assert b.bytes_per_s("host") is None and b.expected_s(("host",), MiB) is None
    b.observe("host", MiB, 0.001)
    assert b.expected_s(("host",), MiB) == pytest.approx(0.001)


def test_expected_time_sums_the_path():
    b = _bw(nvme=1.0, host=10.0)
    assert b.expected_s(("nvme", "host"), 10**9) == pytest.approx(1.0 + 0.1)
    assert b.expected_s(("remote", "host"), 10**9) is None


def test_encoder_cost_configured_is_fixed_learned_needs_steps():
    fixed = EncoderCost(1e-5)
    fixed.observe(100, 1.0)
    assert fixed.seconds(1000) == pytest.approx(0.01) and fixed.source == "configured"
    learned = EncoderCost(alpha=0.5, min_samples=2)
    learned.observe(1000, 0.02)
    assert learned.seconds(1000) is None and learned.source == "unknown"
    learned.observe(1000, 0.04)
    assert learned.seconds_per_token() == pytest.approx(3e-5) and learned.source == "learned"
    with pytest.raises(ValueError, match="seconds_per_token"):
        EncoderCost(0)
    with pytest.raises(ValueError, match="alpha"):
        TierBandwidth(alpha=1.5)


def test_recompute_when_loading_is_slower_than_encoding():
    # NVMe at 0.5 GB/s + host at 10 GB/s; encoder 20 us per token:
    # N = 4096 (64 MiB): load 0.134 + 0.0067 s > recompute 0.082 s -> recompute
    # N = 64 (1 MiB): load 2.2 ms > recompute 1.3 ms -> recompute; host-only at N = 4096: load 6.7 ms -> load
    p = RecomputePolicy(_bw(nvme=0.5, host=10.0), EncoderCost(20e-6), explore_every=0)
    d = p.decide(("nvme", "host"), 4096 * ROW, 4096)
    assert d.recompute and d.load_s == pytest.approx(4096 * ROW / 0.5e9 + 4096 * ROW / 10e9)
    assert d.recompute_s == pytest.approx(4096 * 20e-6)
    assert not p.decide(("host",), 4096 * ROW, 4096).recompute
    # a fast NVMe (5 GB/s): load 14.8 ms < recompute 82 ms -> load
    assert not RecomputePolicy(_bw(nvme=5.0, host=10.0), EncoderCost(20e-6)).decide(
        ("nvme", "host"), 4096 * ROW, 4096).recompute


def test_unknown_estimates_always_load():
    assert not RecomputePolicy(TierBandwidth(), EncoderCost(1e-9)).decide(("nvme", "host"), 64 * MiB, 4096).recompute
    d = RecomputePolicy(_bw(nvme=0.001, host=0.001), EncoderCost()).decide(("nvme", "host"), 64 * MiB, 4096)
    assert not d.recompute and d.recompute_s is None


def test_every_nth_would_be_recompute_is_loaded_to_refresh_the_estimate():
    p = RecomputePolicy(_bw(nvme=0.1, host=1.0), EncoderCost(1e-9), explore_every=4)
    got = [p.decide(("nvme", "host"), MiB, 64) for _ in range(8)]
    assert [d.recompute for d in got] == [True, True, True, False] * 2
    assert [d.explored for d in got] == [False, False, False, True] * 2
    with pytest.raises(ValueError, match="explore_every"):
        RecomputePolicy(TierBandwidth(), EncoderCost(), explore_every=-1)


def test_snapshot_names_sources():
    p = RecomputePolicy(_bw(host=10.0), EncoderCost(2e-5))
    snap = p.snapshot()
    assert snap["encoder_source"] == "configured" and snap["encoder_seconds_per_token"] == 2e-5
    assert snap["tiers"]["host"]["bytes_per_s"] == pytest.approx(10e9)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _slow_promotions(lor: LoadOrRecompute, clock: Clock, n: int, nbytes: int, seconds: float) -> None:
    """``n`` promotions seen pending at t and t + seconds, ready one step later."""
    for i in range(n):
        assert not lor.check(f"seen{i}", "wait", nbytes, 64)
        clock.t += seconds
        assert not lor.check(f"seen{i}", "wait", nbytes, 64)
        clock.t += 0.05
        assert not lor.check(f"seen{i}", "ready", nbytes, 64)


def test_load_or_recompute_learns_promotions_and_worker_loads():
    clock = Clock()
    lor = LoadOrRecompute(True, 1e-6, explore_every=0, now=clock)  # 64 tokens: 64 us to recompute
    # unknown estimates: every promotion is waited for (loaded)
    assert not lor.check("a", "wait", MiB, 64)
    _slow_promotions(lor, clock, 3, MiB, 0.1)  # >= 0.1 s per MiB (the lower end of each bracket)
    assert lor.policy.bandwidth.bytes_per_s("promote") == pytest.approx(MiB / 0.1)
    assert not lor.check("b", "wait", MiB, 64)  # the host reads are still unknown
    for _ in range(3):
        stats = {"load_bytes": MiB, "load_seconds": [0.0005, 0.0005], "encoder_tokens": 9, "encoder_seconds": 1.0}
        lor.observe_report(stats)
        assert "encoder_tokens" not in stats and "encoder_seconds" not in stats and stats["load_bytes"] == MiB
    assert lor.policy.bandwidth.bytes_per_s("host") == pytest.approx(MiB / 0.001)
    assert lor.policy.encoder.seconds_per_token() == 1e-6  # configured: the reports do not change it
    assert lor.check("c", "wait", MiB, 64)  # 0.101 s to load > 64 us to recompute
    assert not lor.check("c", "ready", 64, 64)  # no pending promotion left for a settled item
    assert not lor.check("host-hit", "ready", MiB, 64)  # found in the host tier: never recomputed


def test_promotion_within_one_step_is_no_observation():
    clock = Clock()
    lor = LoadOrRecompute(True, 1e-9, now=clock)
    for i in range(5):
        lor.check(f"k{i}", "wait", MiB, 64)
        clock.t += 0.03
        lor.check(f"k{i}", "ready", MiB, 64)
    assert lor.policy.bandwidth.bytes_per_s("promote") is None


def test_load_or_recompute_disabled_and_learned_encoder_cost():
    clock = Clock()
    off = LoadOrRecompute(False, 1e-9, now=clock)
    _slow_promotions(off, clock, 3, MiB, 10.0)
    assert not off.check("x", "wait", MiB, 64) and off.policy.bandwidth.bytes_per_s("promote") is None
    learned = LoadOrRecompute(True, None, now=clock)
    for _ in range(3):
        learned.observe_report({"encoder_tokens": 1000, "encoder_seconds": 0.02})
    assert learned.policy.encoder.seconds_per_token() == pytest.approx(2e-5)
    assert learned.policy.encoder.source == "learned"


class Event:
    def __init__(self, ms: float, done: bool = True) -> None:
        self.ms, self.done = ms, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: "Event") -> float:
        return other.ms - self.ms


def test_encoder_step_timer_wall_clock_minus_saves():
    t = EncoderStepTimer()
    t.begin((10.0, None))
    t.item(64, (10.5, None))  # encoder ran 0.5 s
    t.saved(0.2)  # the first save took 0.2 s ...
    t.item(36, (11.0, None))  # ... so the second item's 0.5 s after it are 0.3 s of encoder
    t.saved(0.2)  # the last save is not inside the measured window
    assert t.take() == [(100, pytest.approx(0.8))]
    assert t.take() == []
    t.begin((20.0, None))
    assert t.take() == []  # a step that encoded nothing


def test_encoder_step_timer_cuda_events_wait_for_completion():
    t = EncoderStepTimer()
    last = Event(250.0, done=False)
    t.begin((0.0, Event(100.0)))
    t.item(1000, (0.001, last))  # the CPU only launched the kernels: GPU time comes from the events
    assert t.take() == []
    t.begin((0.002, Event(300.0)))  # the next step starts before the last event completed
    last.done = True
    assert t.take() == [(1000, pytest.approx(0.150))]


def test_extra_config_keys():
    from ectier.errors import ConfigError
    from ectier_vllm.config import settings_from_extra_config

    s = settings_from_extra_config({}, default_ns="m")
    assert s.recompute is True and s.encoder_seconds_per_token is None
    s = settings_from_extra_config({"mode": "daemon", "recompute": False, "encoder_seconds_per_token": 2e-5},
                                   default_ns="m")
    assert s.recompute is False and s.encoder_seconds_per_token == 2e-5
    with pytest.raises(ConfigError, match=r"ec_connector_extra_config\.recompute: expected true or false"):
        settings_from_extra_config({"recompute": "yes"}, default_ns="m")
    with pytest.raises(ConfigError, match=r"ec_connector_extra_config\.encoder_seconds_per_token"):
        settings_from_extra_config({"encoder_seconds_per_token": 0}, default_ns="m")


# ------------------------------------------------- `ectier bench crossover`: the tiers and the model


def _tier_rows(tier: str, op: str, gbps: float, ns=(64, 1024, 4096)) -> list[dict]:
    return [{"tier": tier, "op": op, "impl": "ectier", "num_tokens": n, "p50_s": n * ROW / (gbps * 1e9)} for n in ns]


def test_crossover_with_the_connectors_per_token_rule(tmp_path):
    import json

    from click.testing import CliRunner

    from ectier.bench.crossover import crossover
    from ectier.bench.crossover_cmd import per_token_cost
    from ectier.cli import main

    # recompute = 20 us/token; loading costs ROW bytes/token: host (10 GB/s) 1.6 ns/token always wins,
    # a 0.5 GB/s tier costs 32.8 us/token: never wins, at any N
    cost = per_token_cost(20e-6)
    assert cost.seconds(1000) == pytest.approx(0.02) and cost.source == "configured"
    cross = crossover(_tier_rows("host", "get", 10.0) + _tier_rows("remote", "get", 0.5), cost)
    assert cross["host"]["crossover_tokens"] is None
    assert cross["remote"]["crossover_tokens"] == 64  # loading stops winning at the smallest N
    saved = tmp_path / "tiers.json"
    saved.write_text(json.dumps({"rows": _tier_rows("host", "get", 10.0) + _tier_rows("nvme", "get", 1.0)}))
    res = CliRunner().invoke(main, ["bench", "crossover", "--tiers-json", str(saved), "--encoder-seconds-per-token",
                                    "2e-5", "--out", str(tmp_path / "o"), "-q"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    out = json.loads((tmp_path / "o" / "crossover.json").read_text())
    assert out["cost_model"]["source"] == "configured" and out["cost_model"]["b_s_per_token"] == 2e-5
    assert out["tiers"]["nvme"]["crossover_tokens"] is None  # 1 GB/s: 16.4 us/token < 20 us/token
    md = (tmp_path / "o" / "crossover.md").read_text()
    assert "encoder us/token there" in md and "| 20.00 |" in md and "not measured (no --remote-config)" in md
    res = CliRunner().invoke(main, ["bench", "crossover", "--tiers-json", str(saved), "--encoder-seconds-per-token",
                                    "0", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "--encoder-seconds-per-token" in res.output


def test_remote_rows_on_an_in_memory_backend():
    from ectier import testing
    from ectier.bench.crossover import crossover
    from ectier.bench.remote_rows import measure_remote
    from ectier.config import CacheConfig
    from ectier.errors import ConfigError

    backend = testing.MemoryBackend()
    cfg = CacheConfig.from_dict({"remote": {"backend": "redis", "addresses": "unused:1"}})
    rows = measure_remote(cfg, (16, 64), budget_bytes=1 << 20,
                          open_cache=lambda c: testing.make_cache(c, remote_backend=backend))
    assert [(r["tier"], r["op"], r["impl"], r["num_tokens"]) for r in rows] == [("remote", "get", "ectier", 16),
                                                                                ("remote", "get", "ectier", 64)]
    assert all(r["reps"] >= 3 and r["p50_s"] > 0 for r in rows)
    from ectier.bench.crossover_cmd import per_token_cost

    assert "remote" in crossover(rows, per_token_cost(1e-5))
    with pytest.raises(ConfigError, match="remote.backend"):
        measure_remote(CacheConfig(), (16,))



def test_an_explored_item_stays_loaded_until_its_promotion_is_done():
    """Of the items the estimates would recompute, the explored one is waited for in the later
    steps too (not recomputed the next step), and its promotion is observed; one done within one
    step is observed with its upper end, so a tier that got faster refreshes a stale estimate."""
    clock = Clock()
    lor = LoadOrRecompute(True, 1e-6, explore_every=2, now=clock)  # 64 tokens: 64 us to recompute
    _slow_promotions(lor, clock, 3, MiB, 0.1)  # slow: 0.1 s per MiB
    for _ in range(3):
        lor.observe_report({"load_bytes": MiB, "load_seconds": [0.001]})
    reads = lambda: lor.policy.bandwidth.snapshot()["promote"]["reads"]  # noqa: E731
    assert lor.check("r", "wait", MiB, 64)  # recomputed
    assert not lor.check("x", "wait", MiB, 64)  # the 2nd that would be recomputed: explored
    for _ in range(3):  # later steps, still promoting: still waited for, not recomputed
        clock.t += 0.01
        assert not lor.check("x", "wait", MiB, 64)
    clock.t += 0.01
    assert not lor.check("x", "ready", MiB, 64)
    assert reads() == 4  # observed: 0.03 s for a MiB (the lower end)
    assert lor.check("y", "wait", MiB, 64)  # still slower than recomputing: the 3rd is recomputed
    assert not lor.check("z", "wait", MiB, 64)  # the 4th: explored
    clock.t += 0.002  # seen done the next step: within one step, its upper end (2 ms) is observed
    assert not lor.check("z", "ready", MiB, 64)
    assert reads() == 5
    assert lor.policy.bandwidth.bytes_per_s("promote") > MiB / 0.03


def test_a_promotion_given_up_teaches_that_the_tier_is_slow():
    """A tier measured fast (0.08 s per MiB) turns so slow that promotions pass ``load_timeout_s``
    (1 s here). A timeout used to teach nothing: every later item waited the full second before it
    was encoded (an encoder at 0.2 s per item); now the time waited counts as a lower bound of the
    promotion's, and the next item is recomputed at once."""
    clock = Clock()
    lor = LoadOrRecompute(True, 0.2 / 64, explore_every=0, now=clock)
    for _ in range(3):  # host reads known
        lor.observe_report({"load_bytes": MiB, "load_seconds": [0.001]})
    _slow_promotions(lor, clock, 3, MiB, 0.08)
    assert not lor.check("fast", "wait", MiB, 64)  # 0.08 s to load < 0.2 s to encode
    before = lor.policy.bandwidth.bytes_per_s("promote")
    waited = 0
    while not lor.check(f"slow{waited}", "wait", MiB, 64):  # recomputed without a wait, in the end
        clock.t += 1.0
        assert not lor.check(f"slow{waited}", "timeout", MiB, 64)
        waited += 1
        assert waited <= 6, f"still waiting for a promotion after {waited} timeouts"
    assert lor.policy.bandwidth.bytes_per_s("promote") < before / 2


def test_a_read_or_step_whose_rate_overflows_or_underflows_is_ignored():
    """Absurd measurements (a subnormal duration from a clock step; a huge byte count): each value
    is a finite number > 0, but the rate is not. Before: a read of rate inf set the tier's EWMA to
    inf for good (no later read can bring (1 - a) * inf back: every item loaded forever), and an
    encoder step of rate 0 made recomputing look free (every item recomputed)."""
    b = TierBandwidth(min_samples=1)
    b.observe("promote", 2**40, 1e-300)  # 2**40 / 1e-300 overflows to inf
    b.observe("promote", MiB, 1.0)
    assert b.bytes_per_s("promote") == pytest.approx(MiB)
    e = EncoderCost(min_samples=1)
    e.observe(10**6, 5e-324)  # 5e-324 / 1e6 underflows to 0.0
    e.observe(1000, 1.0)
    assert e.seconds_per_token() == pytest.approx(1e-3)
