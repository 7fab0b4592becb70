"""Load or recompute (bindings/ectier_vllm/recompute.py): pure logic, no vLLM, no torch."""

from __future__ import annotations

import pytest

from ectier_vllm.recompute import EncoderCost, RecomputePolicy, TierBandwidth

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
