"""``ectier bench connectors`` on a small size: vLLM's ECExampleConnector and ECTierConnector (in-process
host, host over NVMe, daemon, restarted daemon) through vLLM's connector calls, every load bitwise; vLLM's
ECMooncakeConnector (variant ``mooncake``) where the Mooncake client imports, its skip where it does not."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from click.testing import CliRunner

from ectier.cli import main

TIMINGS = ("save_block_s", "save_calls_s", "loadable_s", "lookup_s", "load_s", "consumer_s")
RAN = ("example", "ectier-host", "ectier-nvme", "ectier-daemon", "ectier-daemon-nvme")
#: the Mooncake client (mooncake-transfer-engine-non-cuda; scripts/bootstrap_vllm.sh installs it where it can)
HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None
_ENV_BEFORE = dict(os.environ)


def test_bench_connectors_small_size(tmp_path):
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["bench", "connectors", "--sizes", "16", "--min-reps", "2",
                                    "--variants", ",".join(("cpu", *RAN)),  # mooncake: its own tests below
                                    "--budget-bytes", "64KiB", "--out", str(out), "--quiet",
                                    "--workdir", str(tmp_path)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    data = json.loads((out / "connectors.json").read_text())
    by = {r["variant"]: r for r in data["results"]}
    assert set(by) == {"cpu", *RAN}
    for name in RAN:
        r = by[name]
        assert r["num_tokens"] == 16 and r["nbytes"] == 16 * 8192 * 2 and r["reps"] == 2
        assert r["mismatches"] == 0, name  # every load bitwise equal to what was saved
        assert len(r["samples"]) == 2
        for s in r["samples"]:
            assert all(s[k] > 0 for k in TIMINGS), (name, s)
            assert s["loadable_s"] >= s["save_block_s"] and s["consumer_s"] >= s["lookup_s"] + s["load_s"]
            assert s["lookup_steps"] >= 1
    if not torch.cuda.is_available():
        assert "needs CUDA" in by["cpu"]["skipped"]
        assert "cpu: skipped (ECCPUConnector needs CUDA" in res.output
    summary = {r["variant"]: r for r in data["summary"]}
    assert summary["example"]["consumer_s_vs_example"] == 1.0
    assert summary["ectier-host"]["consumer_s_p90"] >= summary["ectier-host"]["consumer_s_p50"]
    md = (out / "connectors.md").read_text()
    assert "| ectier-daemon-nvme | 16 |" in md
    # nothing left behind: no in-process store open, no daemon socket dir, no connector files
    from ectier_vllm.store import open_stores

    assert open_stores() == 0
    assert [p for p in os.listdir(tmp_path) if p != "out"] == []


def _run(tmp_path, variants: str) -> tuple[str, dict]:
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["bench", "connectors", "--sizes", "16", "--min-reps", "2", "--variants", variants,
                                    "--budget-bytes", "64KiB", "--out", str(out), "--quiet",
                                    "--workdir", str(tmp_path)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output, json.loads((out / "connectors.json").read_text())


def test_bench_connectors_mooncake_variant_runs_where_the_client_imports_and_says_why_not_elsewhere(tmp_path):
    """With the Mooncake client: vLLM's ECMooncakeConnector (producer scheduler + worker, consumer
    scheduler + worker in one process, Mooncake's TransferEngine over tcp on 127.0.0.1, CPU buffers),
    every item pushed, loaded, bitwise. Without it: skipped with vLLM's import error (one test either
    way, so the suite lists no skip)."""
    output, data = _run(tmp_path, "example,mooncake")
    r = {r["variant"]: r for r in data["results"]}["mooncake"]
    if not HAVE_MOONCAKE:
        assert "Install mooncake-transfer-engine to use ECMooncakeConnector" in r["skipped"]
        assert "No module named 'mooncake'" in r["skipped"]
        assert "mooncake: skipped (Install mooncake-transfer-engine" in output
        return
    assert "skipped" not in r, r.get("skipped")
    assert r["num_tokens"] == 16 and r["reps"] == 2 and r["mismatches"] == 0 and len(r["samples"]) == 2
    for s in r["samples"]:
        assert all(s[k] > 0 for k in TIMINGS), s
        assert s["loadable_s"] >= s["save_block_s"] and s["consumer_s"] >= s["lookup_s"] + s["load_s"]
        assert s["lookup_steps"] >= 2  # vLLM defers a pushed item one step: a worker step hands it over
    assert "| mooncake | 16 |" in (tmp_path / "out" / "connectors.md").read_text()
    assert [p for p in os.listdir(tmp_path) if p != "out"] == []
    assert os.environ.get("VLLM_HOST_IP") == _ENV_BEFORE.get("VLLM_HOST_IP")  # set for the run only


def test_bench_connectors_runs_without_vllm_target_device_on_a_cpu_machine(tmp_path):
    """A user without a GPU runs the command as the docs say, without setting VLLM_TARGET_DEVICE:
    vLLM then failed with "Failed to infer device type" and a traceback."""
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: vLLM infers its device")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TARGET_DEVICE"}
    r = subprocess.run([sys.executable, "-m", "ectier.cli", "bench", "connectors", "--sizes", "16", "--min-reps", "1",
                        "--variants", "example,ectier-host", "--quiet", "--out", str(tmp_path / "out"),
                        "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Failed to infer device type" not in r.stderr
