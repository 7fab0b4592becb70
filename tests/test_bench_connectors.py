"""``ectier bench connectors`` without vLLM: its summary (medians, p90, ratios vs ECExampleConnector,
verdict), re-rendering a saved result, and the one-line refusal where vLLM is not importable.
(The run itself, through vLLM's connectors, is tests_vllm/test_bench_connectors.py.)"""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner

from ectier.bench.connectors import reps_for, summarize, table, verdict
from ectier.cli import main

KEYS = ("save_block_s", "save_calls_s", "loadable_s", "lookup_s", "load_s", "consumer_s")


def _result(variant, n, consumer_ms, *, mismatches=0):
    samples = [{**{k: c / 1e3 for k in KEYS}, "lookup_steps": 1} for c in consumer_ms]
    return {"variant": variant, "num_tokens": n, "nbytes": n * 8192 * 2, "reps": len(samples),
            "samples": samples, "mismatches": mismatches}


RESULTS = [
    _result("example", 64, [10, 20, 30, 40, 50]),
    _result("ectier-host", 64, [1, 2, 3, 4, 100]),
    _result("example", 1024, [10, 10, 10]),
    _result("ectier-host", 1024, [20, 20, 20]),
    {"variant": "cpu", "num_tokens": 64, "skipped": "ECCPUConnector needs CUDA"},
]


def test_summary_medians_p90_and_ratios():
    rows = {(r["variant"], r["num_tokens"]): r for r in summarize(RESULTS)}
    host = rows[("ectier-host", 64)]
    assert host["consumer_s_p50"] == pytest.approx(0.003)
    assert host["consumer_s_p90"] == pytest.approx(0.0616)  # numpy's linear quantile of 1,2,3,4,100 ms
    assert host["consumer_s_vs_example"] == pytest.approx(30 / 3)  # example's median / this one's
    assert rows[("ectier-host", 1024)]["consumer_s_vs_example"] == pytest.approx(0.5)
    assert rows[("example", 64)]["consumer_s_vs_example"] == 1.0
    assert rows[("cpu", 64)] == {"variant": "cpu", "num_tokens": 64, "skipped": "ECCPUConnector needs CUDA"}
    lines = verdict(summarize(RESULTS))
    assert ("ectier-host: whole consumer side faster than ECExampleConnector at N = 64; not faster at N = 1024; "
            "worker blocked saving p50 3000-20000 us per item (goal <= 100 us on CPU: NOT met)") in lines
    assert "cpu: skipped (ECCPUConnector needs CUDA)" in lines
    one = verdict(summarize(RESULTS[:1] + [_result("ectier-nvme", 64, [50, 60])]))
    assert any(x.startswith("ectier-nvme: whole consumer side faster than ECExampleConnector at no N; not faster "
                            "at N = 64; worker blocked saving p50 ") and " us per item" in x and "-" not in
               x.split("p50 ")[1].split(" us")[0] for x in one), one  # ("at N = none", "p50 27-27 us" before)
    headers, cells = table(summarize(RESULTS))
    assert len(cells) == 4 and cells[1][headers.index("consumer vs example")] == "10.00x"


def test_mismatch_is_named_and_fails_the_command(tmp_path):
    bad = RESULTS[:1] + [_result("ectier-host", 64, [1, 2], mismatches=1)]
    assert "BITWISE MISMATCHES: ectier-host N=64" in verdict(summarize(bad))
    saved = tmp_path / "connectors.json"
    saved.write_text(json.dumps({"command": "connectors", "results": bad}))
    res = CliRunner().invoke(main, ["bench", "connectors", "--from-json", str(saved), "--out", str(tmp_path / "o")])
    assert res.exit_code == 1 and "not bitwise equal" in res.output


def test_from_json_rerenders_without_vllm(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    saved = tmp_path / "connectors.json"
    saved.write_text(json.dumps({"command": "connectors", "results": RESULTS}))
    out = tmp_path / "o"
    res = CliRunner().invoke(main, ["bench", "connectors", "--from-json", str(saved), "--out", str(out)],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "| ectier-host | 1024 |" in (out / "connectors.md").read_text()
    assert json.loads((out / "connectors.json").read_text())["summary"][1]["consumer_s_vs_example"] == pytest.approx(10)


def test_without_vllm_one_line_and_exit_1(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    res = CliRunner().invoke(main, ["bench", "connectors", "--sizes", "16", "--out", str(tmp_path)])
    assert res.exit_code == 1
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "vLLM is not importable" in lines[0], res.output


@pytest.mark.parametrize("args, needle", [(["--sizes", "0"], "--sizes"), (["--variants", "examp"], "examp"),
                                          (["--budget-bytes", "lots"], "--budget-bytes"),
                                          (["--budget-bytes", "0"], "--budget-bytes")])
def test_bad_options_name_the_option(tmp_path, args, needle):
    res = CliRunner().invoke(main, ["bench", "connectors", *args, "--out", str(tmp_path)])
    assert res.exit_code == 2 and needle in res.output, res.output


def test_reps_for_budget():
    assert reps_for(1 << 20, 256 << 20) == 30 and reps_for(64 << 20, 256 << 20) == 5
    assert reps_for(16 << 20, 256 << 20) == 16
    with pytest.raises(ValueError, match="nbytes"):
        reps_for(0, 1)
