"""``ectier demo``: the main job, in small and fast runs, plus its building blocks.

The small runs use the first six scikit-image photographs (~19 MiB of Qwen3-VL encoder outputs) with
budgets far below that, so entries are evicted from the host arena, demoted to NVMe and promoted back.
"""

from __future__ import annotations

import io
import json
import os
import types

import numpy as np
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

    monkeypatch.setattr(demo_workload, "_import_skimage", no_skimage)
    console = Console(record=True, width=200)
    s = demo.run_demo(demo.DemoOptions(images=5, requests=15, host_bytes=3 << 20, nvme_bytes=8 << 20,
                                       dir=str(tmp_path)), console=console)
    assert "scikit-image is not installed" in console.export_text()
    assert s["image_source"] == "synthetic"
    assert all(im["source"] == "synthetic" for im in s["images"])
    assert s["ok"] and s["ectier"]["hits"] > 0


# ============================================================================== building blocks


def test_load_images_skips_photographs_that_need_a_download(monkeypatch):
    real = demo_workload._import_skimage()

    def offline(exc):
        def loader():
            raise exc
        return loader

    fake = types.SimpleNamespace(**{name: getattr(real, name) for name in demo.SKIMAGE_PHOTOS})
    fake.camera = offline(ModuleNotFoundError("requires pooch"))
    fake.coffee = offline(ConnectionError("network is unreachable"))
    monkeypatch.setattr(demo_workload, "_import_skimage", lambda: fake)
    notes = []
    images, origin = demo.load_images(warn=notes.append)
    names = [im.name for im in images]
    assert origin == "scikit-image"
    assert "camera" not in names and "coffee" not in names and "astronaut" in names
    assert sum("skipped" in n for n in notes) == 2
    # the seed sizes are still there, made from real photographs
    sizes = {(im.width, im.height) for im in images if im.source == "skimage-resized"}
    assert sizes == {(256, 256), (1024, 1024), (1920, 1080)}


def test_working_set_has_the_seed_sizes_and_distinct_keys():
    images, origin = demo.load_images()
    assert origin == "scikit-image"
    assert len({im.mm_hash for im in images}) == len(images) >= 15
    seed_sizes = {(im.width, im.height) for im in images if im.source == "skimage-resized"}
    assert seed_sizes == {(256, 256), (1024, 1024), (1920, 1080)}
    assert {im.name for im in images} >= {"astronaut", "coffee", "retina", "hubble_deep_field"}
    for im in images:
        assert im.pixels.dtype == np.uint8


def test_an_images_limit_above_the_working_set_says_so():
    notes: list[str] = []
    images, _ = demo.load_images()
    more, _ = demo.load_images(len(images) + 79, warn=notes.append)
    assert [im.mm_hash for im in more] == [im.mm_hash for im in images]
    assert any(f"images: {len(images) + 79} asked for" in n and f"has {len(images)}" in n for n in notes), notes
    notes.clear()
    demo.load_images(len(images), warn=notes.append)
    assert not any("asked for" in n for n in notes)


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


def test_mm_hash_is_a_content_hash():
    a = np.arange(12, dtype=np.uint8).reshape(3, 4)
    assert demo.mm_hash(a) == demo.mm_hash(a.copy())
    assert len(demo.mm_hash(a)) == 64
    b = a.copy()
    b[0, 0] += 1
    assert demo.mm_hash(a) != demo.mm_hash(b)
    assert demo.mm_hash(a) != demo.mm_hash(a.reshape(4, 3))  # same bytes, other shape


def test_stand_in_encoder_shapes_and_determinism():
    enc = demo.StandInEncoder()
    rng = np.random.default_rng(0)
    for w, h, n in ((256, 256, 64), (1024, 1024, 1024), (1920, 1080, 2040), (300, 200, None)):
        px = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        out = enc.encode(px)
        assert out.dtype == torch.bfloat16 and out.is_contiguous()
        assert tuple(out.shape) == image_tokens(w, h).shape
        if n is not None:
            assert out.shape[0] == n
        again = demo.StandInEncoder().encode(px)  # another instance, same seed: same bytes
        assert torch.equal(out.view(torch.int16), again.view(torch.int16))
    grey = rng.integers(0, 256, (300, 400), dtype=np.uint8)
    out = enc.encode(grey)
    # one pixel changes the output
    grey2 = grey.copy()
    grey2[123, 321] ^= 0x80
    assert not torch.equal(out, enc.encode(grey2))
    g = demo.StandInEncoder("gemma3").encode(grey)
    assert tuple(g.shape) == (256, 5376) and g.dtype == torch.bfloat16
    with pytest.raises(ConfigError, match="pixels"):
        enc.encode(grey.astype(np.float32))


_ENCODE_DIGESTS = """
import hashlib, sys
import numpy as np
import ectier.demo as demo
rng = np.random.default_rng(5)
h = hashlib.blake2b(digest_size=16)
for w, hgt, ch in ((640, 427, 3), (384, 303, 0), (600, 400, 3), (512, 512, 4)):
    shape = (hgt, w, ch) if ch else (hgt, w)
    h.update(demo.StandInEncoder().encode(rng.integers(0, 256, shape, dtype=np.uint8)).view(-1).view(
        __import__("torch").uint8).numpy().tobytes())
print(h.hexdigest())
"""


def test_stand_in_encoder_bytes_do_not_depend_on_the_cpu_kernels():
    """The demo verifies every hit against a recomputation, so the encoder must give the same bytes
    whatever kernels compute it: here torch's scalar (non-vectorised) kernels and MKL restricted to
    AVX2. The former float ``tanh(features @ P)`` gave other bytes under both (a vectorised vs
    scalar ``tanh``; MKL's AVX2 vs AVX-512 sgemm), so the demo could report a correct hit as a
    mismatch (once: 12 mismatches = every later hit of one entry, in ectier and the baseline alike).
    """
    import subprocess
    import sys

    def digest(**env):
        full = {**os.environ, **env}
        r = subprocess.run([sys.executable, "-c", _ENCODE_DIGESTS], env=full, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    base = digest()
    assert digest(ATEN_CPU_CAPABILITY="default") == base
    assert digest(MKL_ENABLE_INSTRUCTIONS="AVX2", OMP_NUM_THREADS="1") == base


def test_stand_in_encoder_arithmetic_is_exact():
    enc = demo.StandInEncoder()
    proj = enc._proj
    assert torch.equal(proj, proj.round()) and proj.abs().max() <= 255
    # features are integers 0..1020 over 51 terms: every partial sum of features @ P is exact in float32
    assert proj.shape[0] * 1020 * 255 < 2**24
    px = np.random.default_rng(1).integers(0, 256, (427, 640, 3), dtype=np.uint8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = enc.encode(px)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one.view(torch.int16), demo.StandInEncoder().encode(px).view(torch.int16))


def test_zipf_stream():
    a = demo.zipf_stream(10, 2000, 1.1, seed=7)
    assert a == demo.zipf_stream(10, 2000, 1.1, seed=7)
    assert a != demo.zipf_stream(10, 2000, 1.1, seed=8)
    counts = np.bincount(a, minlength=10)
    assert sorted(counts)[-1] > 4 * sorted(counts)[0]  # skewed
    uniform = np.bincount(demo.zipf_stream(10, 5000, 0.0, seed=1), minlength=10)
    assert uniform.min() > 350
    for args, field in (((0, 5, 1.0, 0), "images"), ((3, 0, 1.0, 0), "requests"), ((3, 5, -1.0, 0), "zipf"),
                        ((3, 5, float("nan"), 0), "zipf"), ((3, 10**11, 1.0, 0), "requests"),
                        ((3, 5, 1.0, -1), "seed")):
        with pytest.raises(ConfigError, match=field):
            demo.zipf_stream(*args)


def test_safetensors_baseline_layout_and_round_trip(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    store = demo.SafetensorsPerItemStore(tmp_path)
    key = "ab" * 32
    t = torch.randn(64, 8192).to(torch.bfloat16)
    assert not store.has(key)
    store.save(key, t)
    path = tmp_path / key / "encoder_cache.safetensors"
    assert store.has(key) and path.is_file()
    assert set(safetensors_torch.load_file(str(path))) == {"ec_cache"}
    back = store.load(key)
    assert back.dtype == t.dtype and torch.equal(back.view(torch.int16), t.view(torch.int16))
    with pytest.raises(FileNotFoundError):
        store.load("cd" * 32)


def test_same_bytes_is_bitwise():
    a = torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    b = torch.tensor([-0.0, 1.0], dtype=torch.bfloat16)
    assert torch.equal(a, b)  # equal as numbers ...
    assert not demo._same_bytes(a, b)  # ... not as bytes
    assert demo._same_bytes(a, a.clone())
    assert not demo._same_bytes(a, a.to(torch.float16))
    assert not demo._same_bytes(a, a.reshape(2, 1))
    odd = torch.arange(3, dtype=torch.uint8)
    assert demo._same_bytes(odd, odd.clone()) and not demo._same_bytes(odd, odd + 1)


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
