"""``ectier demo``: the main job, in small and fast runs (its building blocks: test_demo_parts.py).

The small runs use the first six scikit-image photographs (~19 MiB of Qwen3-VL encoder outputs) with
budgets far below that, so entries are evicted from the host arena, demoted to NVMe and promoted back."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console

import ectier.demo as demo
import ectier.demo_workload as demo_workload
from ectier.cache import TieredCache
from ectier.cli import main
from ectier.errors import ConfigError
from ectier.sizing import image_tokens


# first six photographs: astronaut, camera, chelsea, coffee, rocket, coins (~19.4 MiB in all)
SMALL = ["--images", "6", "--requests", "40", "--zipf", "0.8", "--seed", "3",
         "--host-bytes", "6MiB", "--nvme-bytes", "10MiB"]


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner(env={"COLUMNS": "120"})


def _run(runner, tmp_path, *args):
    path = tmp_path / "summary.json"
    result = runner.invoke(main, ["demo", *args, "--json", str(path)], catch_exceptions=False)
    summary = json.loads(path.read_text()) if path.exists() else None
    return result, summary


# ======================================================================================== runs


def test_small_demo_evicts_demotes_promotes_and_verifies(runner, tmp_path):
    (tmp_path / "stores").mkdir()  # --dir must exist (the demo never creates it)
    result, s = _run(runner, tmp_path, *SMALL, "--quiet", "--dir", str(tmp_path / "stores"))
    assert result.exit_code == 0, result.output
    assert result.output.startswith("OK:")
    ect = s["ectier"]
    host = ect["stats"]["tiers"]["host"]
    nvme = ect["stats"]["tiers"]["nvme"]
    assert s["ok"] is True and s["mismatches"] == 0 and ect["mismatches"] == 0
    assert ect["hits"] > 0 and ect["misses"] > 0
    assert ect["hits"] + ect["misses"] == 40
    assert host["evictions"] > 0 and host["demotions"] > 0 and host["promotions"] > 0
    assert ect["nvme_hits"] > 0 and ect["host_hits"] > 0
    assert nvme["puts"] > 0
    assert host["used_bytes"] <= host["capacity_bytes"] == 6 << 20
    assert nvme["used_bytes"] <= nvme["capacity_bytes"] == 10 << 20
    # the baseline ran on the same stream and never evicts: a miss only on first sight
    base = s["baseline"]
    assert base is not None and base["mismatches"] == 0
    assert base["requests"] == 40 and base["misses"] == sum(1 for im in s["images"] if im["requests"])
    assert base["hits"] == 40 - base["misses"] > 0
    assert set(s["speedup"]) == {"load", "save", "total"}
    assert all(v is None or v > 0 for v in s["speedup"].values())
    assert ect["get_gbps"] > 0 and ect["put_gbps"] > 0 and ect["encoder_saved_s"] > 0
    # the store lived in a fresh subdirectory of --dir and was removed
    assert os.listdir(tmp_path / "stores") == []
    # the images are the real photographs at their native sizes, keyed by 64-hex mm_hash
    assert s["image_source"] == "scikit-image"
    assert [im["name"] for im in s["images"]] == ["astronaut", "camera", "chelsea", "coffee", "rocket", "coins"]
    for im in s["images"]:
        assert len(im["mm_hash"]) == 64 and int(im["mm_hash"], 16) >= 0
        assert im["nbytes"] == image_tokens(im["width"], im["height"]).nbytes


def test_demo_prints_the_report(runner, tmp_path):
    result, s = _run(runner, tmp_path, *SMALL, "--codec", "zstd-planes")
    assert result.exit_code == 0, result.output
    out = result.output
    for text in ("ectier demo", "working set", "tiers", "demotions", "promotions", "hit rate (items)",
                 "hit rate (bytes)", "GB/s", "saved by", "all byte-exact", "safetensors-per-item", "OK:"):
        assert text in out, text
    assert s["budgets"]["codec"] == "zstd-planes"
    assert s["ectier"]["stats"]["tiers"]["nvme"]["codec"] == "zstd-planes"


def test_demo_report_tables_fit_in_80_columns(tmp_path):
    runner = CliRunner(env={"COLUMNS": "80"})
    result, s = _run(runner, tmp_path, *SMALL)
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    # ... and not because rich folded cells: rendered 200 wide, every table line is still <= 80
    wide = Console(width=200, record=True, file=io.StringIO())
    demo.print_summary(s, wide)
    table_lines = [line.rstrip() for line in wide.export_text().splitlines() if any(c in line for c in "│┃━")]
    assert len(table_lines) > 20
    assert max(len(line) for line in table_lines) <= 80, max(table_lines, key=len)


@pytest.mark.parametrize("where", ["/proc", "/sys/kernel"])
def test_demo_dir_where_nothing_can_be_made_is_a_usage_error_naming_dir(runner, where):
    if not os.path.isdir(where):
        pytest.skip(f"{where} is not a directory here")
    result = runner.invoke(main, ["demo", *SMALL, "--quiet", "--dir", where])
    assert result.exit_code == 2, result.output
    assert "--dir" in result.output and "cannot make" in result.output and "hits" not in result.output


def test_demo_nvme_budget_above_the_free_space_names_its_own_option(runner, tmp_path):
    """The cache's message named nvme.thin_provisioning, which the demo has no option for."""
    result = runner.invoke(main, ["demo", "--images", "2", "--quiet", "--dir", str(tmp_path), "--nvme-bytes", "1PiB"])
    assert result.exit_code == 2, result.output
    assert "--nvme-bytes" in result.output and "free" in result.output and "thin_provisioning" not in result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, option", [
    (["--seed", "-1"], "--seed"),
    (["--requests", "100000000000"], "--requests"),
])
def test_demo_stream_options_out_of_range_are_usage_errors(runner, args, option):
    result = runner.invoke(main, ["demo", "--images", "2", "--quiet", *args])
    assert result.exit_code == 2, result.output
    assert option in result.output and "Traceback" not in result.output
    fields = {"images": 1, "requests": 1, option.lstrip("-"): int(args[1])}
    with pytest.raises(ConfigError, match=option.lstrip("-")):  # the library refuses them too
        demo.run_demo(demo.DemoOptions(**fields), quiet=True)


def test_demo_dir_that_does_not_exist_is_refused_not_created(runner, tmp_path):
    missing = tmp_path / "no" / "such"
    result = runner.invoke(main, ["demo", *SMALL, "--quiet", "--dir", str(missing)])
    assert result.exit_code == 2, result.output
    assert "--dir" in result.output and "not an existing directory" in result.output
    assert not (tmp_path / "no").exists()
    with pytest.raises(ConfigError, match="dir"):
        demo.run_demo(demo.DemoOptions(dir=str(missing), images=1, requests=1), quiet=True)
    assert not (tmp_path / "no").exists()


def test_demo_verification_catches_altered_bytes(runner, tmp_path, monkeypatch):
    original_load = TieredCache.load

    def corrupting_load(self, lease, **kwargs):  # the demo's loads: a lease, then a view of it
        out = original_load(self, lease, **kwargs).clone()  # never write into the arena's view
        flat = out.view(-1).view(torch.uint8)
        flat[flat.numel() // 2] ^= 0x01  # one bit of one element
        return out

    monkeypatch.setattr(TieredCache, "load", corrupting_load)
    result, s = _run(runner, tmp_path, *SMALL, "--no-baseline")
    assert result.exit_code == 1, result.output
    assert "MISMATCHED" in result.output and "FAIL" in result.output
    assert s["ok"] is False
    assert s["mismatches"] == s["ectier"]["mismatches"] == s["ectier"]["hits"] > 0
    assert s["ectier"]["mismatch_examples"][0]["mm_hash"] in {im["mm_hash"] for im in s["images"]}
    assert s["baseline"] is None
    # the one-line (--quiet) verdict says which store disagreed with the recomputation
    result, s = _run(runner, tmp_path, *SMALL, "--no-baseline", "--quiet")
    assert result.exit_code == 1
    n = s["ectier"]["mismatches"]
    assert result.output.startswith("FAIL:") and f"{n} mismatches (ectier {n}, baseline -)" in result.output


def test_demo_gemma3_fixed_tokens(runner, tmp_path):
    result, s = _run(runner, tmp_path, "--model", "gemma3", "--images", "5", "--requests", "20",
                     "--host-bytes", "6MiB", "--nvme-bytes", "8MiB", "--no-baseline", "--quiet")
    assert result.exit_code == 0, result.output
    assert s["model"] == {"name": "gemma3", "embed_dim": 5376, "dtype": "bfloat16"}
    assert {im["tokens"] for im in s["images"]} == {256}
    assert s["ectier"]["hits"] > 0 and s["mismatches"] == 0


def test_demo_entry_larger_than_every_tier_is_served_uncached(runner, tmp_path):
    # hubble_deep_field (13.1 MiB) fits neither tier: put refuses it, the demo goes on
    result, s = _run(runner, tmp_path, "--images", "7", "--requests", "30", "--zipf", "0.2",
                     "--host-bytes", "3MiB", "--nvme-bytes", "6MiB", "--no-baseline")
    assert result.exit_code == 0, result.output
    ect = s["ectier"]
    assert ect["put_refused"] > 0 and "EntryTooLargeError" in ect["put_refusal_reasons"]
    assert ect["puts"] + ect["put_refused"] == ect["misses"]
    assert ect["stats"]["tiers"]["host"]["skipped_too_large"] > 0
    assert "puts refused" in result.output
    assert s["ok"]


def test_demo_default_budgets_follow_the_working_set(tmp_path):
    s = demo.run_demo(demo.DemoOptions(images=4, requests=8, baseline=False, dir=str(tmp_path)),
                      console=Console(quiet=True), quiet=True)
    unique = s["unique_bytes"]
    largest = max(im["nbytes"] for im in s["images"])
    assert s["budgets"]["host_bytes"] >= max(unique * demo.DEFAULT_HOST_FRACTION, largest)
    assert s["budgets"]["host_bytes"] < unique
    assert s["budgets"]["nvme_bytes"] >= unique * demo.DEFAULT_NVME_FRACTION
    assert s["ok"]


def test_demo_without_scikit_image_uses_synthetic_pixels(tmp_path, monkeypatch):
    def no_skimage():
        raise ImportError("No module named 'skimage'")

    monkeypatch.setattr(demo_workload, "skimage_data", no_skimage)
    console = Console(record=True, width=200)
    s = demo.run_demo(demo.DemoOptions(images=5, requests=15, host_bytes=3 << 20, nvme_bytes=8 << 20,
                                       dir=str(tmp_path)), console=console)
    assert "scikit-image is not installed" in console.export_text()
    assert s["image_source"] == "synthetic"
    assert all(im["source"] == "synthetic" for im in s["images"])
    assert s["ok"] and s["ectier"]["hits"] > 0


def test_demo_by_size_rows_that_round_alike_get_more_digits(runner, tmp_path):
    """Two entry sizes both shown as "1.1 MiB" were two rows that looked the same."""
    result, s = _run(runner, tmp_path, *SMALL)
    assert result.exit_code == 0, result.output
    row = dict(s["ectier"]["by_size"][0], speedup=1.0)
    s["ectier"]["by_size"] = [dict(row, nbytes=1_110_000), dict(row, nbytes=1_170_000), dict(row, nbytes=4 << 20)]
    out = Console(width=120, record=True, file=io.StringIO())
    demo.print_summary(s, out)
    text = out.export_text()
    assert "1.059 MiB" in text and "1.116 MiB" in text and "4.0 MiB" in text


def test_demo_loads_as_the_connector_does_and_both_sides_touch_every_byte(runner, tmp_path, monkeypatch):
    """ectier's side loads with a lease and a zero-copy view (never ``get`` while a lease can be
    had); each side's every loaded byte is copied once by the consumer's touch, inside its load."""
    import ectier.demo_replay as replay_mod

    def no_get(self, key, **kwargs):
        raise AssertionError("the demo's ectier load went through get, not a lease and a view")

    touched: list[int] = []
    real_touch = replay_mod.Touch.__call__

    def counting_touch(self, t):
        touched.append(t.numel() * t.element_size())
        return real_touch(self, t)

    monkeypatch.setattr(TieredCache, "get", no_get)
    monkeypatch.setattr(replay_mod.Touch, "__call__", counting_touch)
    result, s = _run(runner, tmp_path, *SMALL, "--quiet")
    assert result.exit_code == 0, result.output
    ect, base = s["ectier"], s["baseline"]
    assert ect["nvme_hits"] > 0 and ect["host_hits"] > 0
    assert len(touched) == ect["hits"] + base["hits"]
    assert sum(touched) == ect["hit_bytes"] + base["hit_bytes"]
    rows = ect["by_size"]
    assert sum(r["ectier_loads"] for r in rows) == ect["hits"]
    assert all(r["host_loads"] + r["nvme_loads"] == r["ectier_loads"] for r in rows)
    assert sum(r["host_loads"] for r in rows) == ect["host_hits"]
    assert sum(r["nvme_loads"] for r in rows) == ect["nvme_hits"]
    assert sum(r["baseline_loads"] for r in rows) == base["hits"]
    assert all(r["speedup"] is None or r["speedup"] > 0 for r in rows)
    assert {r["nbytes"] for r in rows} <= {im["nbytes"] for im in s["images"]}


def test_a_budget_the_tiers_refuse_is_named_by_its_flag(runner, tmp_path):
    result = runner.invoke(main, ["demo", "--images", "1", "--requests", "1", "--quiet", "--dir", str(tmp_path),
                                  "--host-bytes", "1KiB"])
    assert result.exit_code != 0 and "--host-bytes (host.capacity_bytes)" in result.output, result.output


def test_demo_by_size_table_splits_loads_by_the_tier_that_served_them(runner, tmp_path):
    """A size loaded from both tiers showed one GB/s: host hits beating the baseline and NVMe hits
    losing to it looked like one middling figure."""
    result, s = _run(runner, tmp_path, *SMALL)
    assert result.exit_code == 0, result.output
    row = dict(s["ectier"]["by_size"][0], speedup=1.0, baseline_gbps=2.0)
    s["ectier"]["by_size"] = [dict(row, nbytes=1 << 20, host_loads=3, host_gbps=4.25, nvme_loads=2, nvme_gbps=1.5),
                              dict(row, nbytes=4 << 20, host_loads=0, host_gbps=None, nvme_loads=1, nvme_gbps=2.5)]
    out = Console(width=120, record=True, file=io.StringIO())
    demo.print_summary(s, out)
    text = out.export_text()
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("1.0 MiB"))
    assert "3+2" in line and "4.25 GB/s" in line and "1.50 GB/s" in line, line
    assert "  host hits faster at 1 of 1 of their sizes, NVMe hits at 1 of 2" in text, text


def test_demo_json_into_a_missing_directory_is_refused_before_the_run(runner, tmp_path):
    """Regression: the whole replay ran first, then the write failed and the results were lost."""
    result = runner.invoke(main, ["demo", *SMALL, "--quiet", "--dir", str(tmp_path),
                                  "--json", str(tmp_path / "missing" / "x.json")])
    assert result.exit_code == 2, result.output
    assert "--json: cannot write" in result.output and "No such file or directory" in result.output
    assert "hits" not in result.output  # refused before any request was replayed


def test_demo_json_dash_writes_the_summary_to_standard_output(runner, tmp_path):
    """``--json -``: standard output holds the JSON alone (the report goes to standard error)."""
    result = runner.invoke(main, ["demo", *SMALL, "--quiet", "--dir", str(tmp_path), "--json", "-"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["ok"] is True and summary["ectier"]["hits"] > 0
    assert result.stderr.startswith("OK: "), result.stderr
    assert not (tmp_path / "-").exists() and not os.path.exists("-")


@pytest.mark.parametrize("where", ["", ".", "/proc/x.json"])
def test_demo_json_to_a_place_no_file_can_be_written_is_refused_before_the_run(runner, tmp_path, where):
    result = runner.invoke(main, ["demo", *SMALL, "--quiet", "--dir", str(tmp_path), "--json", where])
    assert result.exit_code == 2, result.output
    assert "hits" not in result.output


def test_demo_killed_with_sigterm_removes_its_stores(tmp_path):
    """``timeout`` and service managers stop with SIGTERM: the run's subdirectory (stores of
    hundreds of MB) is removed as on Ctrl-C (it was left behind)."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "ectier.cli", "demo", "--quiet", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not any(p.name.startswith("ectier-demo-") and "probe" not in p.name for p in tmp_path.iterdir()):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the demo never made its stores"
            time.sleep(0.05)
        time.sleep(0.5)  # into the replay
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
    assert list(tmp_path.iterdir()) == []


def _report_free_bytes(monkeypatch, free: int) -> None:
    """Make every filesystem report ``free`` bytes available (``os.statvfs``)."""
    real = os.statvfs

    def statvfs(path):
        st = real(path)
        fields = list(st)
        fields[4] = free // st.f_frsize  # f_bavail
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", statvfs)


def test_demo_baseline_that_would_fill_the_disk_is_refused_naming_dir_and_no_baseline(runner, tmp_path, monkeypatch):
    """The safetensors baseline keeps every requested item: on a small filesystem it hit ENOSPC
    inside safetensors, a traceback."""
    nvme = 8 << 20
    _report_free_bytes(monkeypatch, nvme + (1 << 20))
    args = ["demo", *SMALL, "--quiet", "--dir", str(tmp_path), "--nvme-bytes", str(nvme)]
    result = runner.invoke(main, args)
    assert result.exit_code == 2, result.output
    assert "--dir" in result.output and "--no-baseline" in result.output and "safetensors baseline" in result.output
    assert "Traceback" not in result.output and list(tmp_path.iterdir()) == []
    result = runner.invoke(main, [*args, "--no-baseline"])
    assert result.exit_code == 0, result.output


def test_demo_baseline_write_failure_is_an_error_line_not_a_traceback(runner, tmp_path, monkeypatch):
    import safetensors
    import safetensors.torch

    def full_disk(*args, **kwargs):
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    result = runner.invoke(main, ["demo", *SMALL, "--quiet", "--dir", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "demo failed" in result.output and "No space left on device" in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert list(tmp_path.iterdir()) == []
