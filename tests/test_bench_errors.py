"""``ectier bench`` usage errors: bad streams, traces, budgets, workdirs, token lists and policies are
refused up front with the option named (exit 2, no traceback, nothing run or written)."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from ectier.cli import main


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


@pytest.mark.parametrize("option", ["--nvme-bytes", "--host-bytes"])
def test_bench_replay_budget_this_machine_cannot_hold_names_the_option(tmp_path, option):
    """A budget the cache refuses on this machine (an NVMe budget above the free disk, a host arena
    that cannot be allocated) is reported against the bench's own option, not a config knob or
    torch's allocator text the bench has no way to set or read."""
    res = CliRunner().invoke(main, ["bench", "replay", "-q", "--no-curve", "--requests", "5", option, "5PiB",
                                    "--workdir", str(tmp_path), "--out", str(tmp_path / "out")])
    assert res.exit_code != 0 and f"{option} (" in res.output and f"lower {option}" in res.output, res.output
    assert "thin_provisioning" not in res.output and "enforce fail" not in res.output
    assert "Traceback" not in res.output


def test_bench_replay_says_why_puts_were_refused(tmp_path):
    """One image larger than the default budgets: every put is refused and the hit rate is 0 %; the
    output says so and which options to raise (it used to show the 0 % alone)."""
    res = CliRunner().invoke(main, ["bench", "replay", "-q", "--no-curve", "--items", "1", "--requests", "5",
                                    "--workdir", str(tmp_path), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # (wrapped to the terminal's width)
    assert "5 of 5 puts were refused" in text and "raise --host-bytes or --nvme-bytes" in text, res.output


def test_bench_tiers_on_a_filesystem_too_small_names_its_own_options(tmp_path, monkeypatch):
    """On a small filesystem the raw reference write came out short and the NVMe store's open failed
    naming nvme.capacity_bytes and nvme.thin_provisioning, which `bench tiers` has no option for."""
    real = os.statvfs

    def statvfs(path):  # every filesystem reports 20 MiB free
        st = real(path)
        fields = list(st)
        fields[4] = (20 << 20) // st.f_frsize  # f_bavail
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", statvfs)
    r = CliRunner().invoke(main, ["bench", "tiers", "-q", "--workdir", str(tmp_path), "--tokens", "4096",
                                  "--out", str(tmp_path / "out")])
    assert r.exit_code == 1, r.output
    assert "--workdir" in r.output and "--budget-bytes" in r.output and "N=4096" in r.output, r.output
    assert "nvme.capacity_bytes" not in r.output and "thin_provisioning" not in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert [p.name for p in tmp_path.iterdir()] in ([], ["out"])


@pytest.mark.parametrize("args, option, text", [
    (["--policy", ""], "--policy", "no policy named in ''"),
    (["--policy", " , "], "--policy", "no policy named in ' , '"),
    (["--policy", "lru,fifo"], "--policy", "unknown policy 'fifo'"),
    (["--width-scale", "3"], "--width-scale", "3 does not divide 8192"),
    (["--curve-scale", "5"], "--curve-scale", "5 does not divide 8192"),
])
def test_bench_replay_names_the_one_option_at_fault_and_why(tmp_path, args, option, text):
    """'--policy ""' said "unknown policy []"; a bad scale named both --width-scale/--curve-scale."""
    res = CliRunner().invoke(main, ["bench", "replay", *args, "--out", str(tmp_path)])
    assert res.exit_code == 2, res.output
    assert f"Invalid value for {option}" in res.output.replace("'", "") and text in res.output, res.output


@pytest.mark.parametrize("command", [["demo"], ["bench", "replay"], ["bench", "baseline"]])
@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_a_bad_zipf_exponent_is_refused_by_the_option_name(tmp_path, command, value):
    """It was refused as 'zipf: must be a finite number >= 0' (no option named) by demo and bench."""
    extra = [] if command == ["demo"] else ["--out", str(tmp_path)]
    res = CliRunner().invoke(main, [*command, "--zipf", value, *extra])
    assert res.exit_code == 2, res.output
    assert "Invalid value for '--zipf'" in res.output or "Invalid value for '--zipf' / '-s'" in res.output, res.output
