"""Shared fixtures of the ectier pytest-benchmark suites (see benchmarks/README.md).

Run::

    .venv/bin/python -m pytest benchmarks -p no:cacheprovider --benchmark-only

Options (each also read from an environment variable):

``--bench-max-tokens N``  (``ECTIER_BENCH_MAX_TOKENS``) largest encoder output measured, in tokens
                          of ``(N, 8192)`` bf16. Default 4096 (64 MiB); 16384 adds 256 MiB.
``--bench-dir PATH``      (``ECTIER_BENCH_DIR``) directory for the NVMe-tier stores and the raw
                          reference files; put it on the disk you mean to measure. Default: a
                          pytest temporary directory.
``--bench-report PATH``   (``ECTIER_BENCH_REPORT``) also write the ratio tables as Markdown.
``--bench-torch-threads K`` (``ECTIER_BENCH_TORCH_THREADS``) ``torch.set_num_threads(K)`` for the
                          whole run (both sides of every comparison). Default: torch's own choice
                          (one per CPU). ``1`` keeps figures stable on a machine shared with
                          other work, where a multi-threaded ``copy_`` stalls on a descheduled worker.

Sizes are the Qwen3-VL encoder outputs of docs/architecture.md ("The tensor"): N tokens -> ``N * 8192 * 2`` bytes
(N=64: 1 MiB, N=1024: 16 MiB, N=4096: 64 MiB, N=16384: 256 MiB).
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("ectier_bench_report", Path(__file__).with_name("report.py"))
report = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = report  # dataclasses look their module up there
_spec.loader.exec_module(report)

WIDTH = 8192  # Qwen3-VL: main merger + 3 deepstack mergers, 4 x 2048
TOKENS = (64, 1024, 4096, 16384)
DEFAULT_MAX_TOKENS = 4096

_RESULTS: list = []  # report.Result of every benchmark of this session
_STATE: dict = {}
_NOTES: list[str] = []  # lines a suite adds to the summary (note())


def note(line: str) -> None:
    """Print ``line`` in the run's summary (after the ratio tables), e.g. a fixed cost per call."""
    _NOTES.append(line)


def entry_bytes(tokens: int) -> int:
    return tokens * WIDTH * 2


def size_id(tokens: int) -> str:
    return f"N={tokens}({entry_bytes(tokens) >> 20}MiB)"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ectier benchmarks")
    group.addoption("--bench-max-tokens", type=int, default=None,
                    help=f"largest N measured (default {DEFAULT_MAX_TOKENS}, env ECTIER_BENCH_MAX_TOKENS)")
    group.addoption("--bench-dir", default=None,
                    help="directory for NVMe stores and raw files (env ECTIER_BENCH_DIR; default: pytest tmp)")
    group.addoption("--bench-report", default=None,
                    help="write the ratio tables as Markdown to this file (env ECTIER_BENCH_REPORT)")
    group.addoption("--bench-torch-threads", type=int, default=None,
                    help="torch.set_num_threads for the run (env ECTIER_BENCH_TORCH_THREADS; default: torch's)")


def _max_tokens(config: pytest.Config) -> int:
    value = config.getoption("--bench-max-tokens")
    if value is None:
        value = int(os.environ.get("ECTIER_BENCH_MAX_TOKENS", DEFAULT_MAX_TOKENS))
    return value


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "tokens" in metafunc.fixturenames:
        limit = _max_tokens(metafunc.config)
        sizes = [n for n in TOKENS if n <= limit] or [TOKENS[0]]
        metafunc.parametrize("tokens", sizes, ids=[size_id(n) for n in sizes])


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def payloads():
    """tokens -> a realistic encoder output: ``torch.randn(N, 8192).bfloat16()`` (seeded)."""
    import torch

    cache: dict[int, "torch.Tensor"] = {}

    def get(tokens: int) -> "torch.Tensor":
        if tokens not in cache:
            g = torch.Generator().manual_seed(tokens)
            cache[tokens] = torch.randn(tokens, WIDTH, generator=g).bfloat16()
        return cache[tokens]

    return get


@pytest.fixture(scope="session")
def bench_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where NVMe stores and raw reference files live (see ``--bench-dir``)."""
    chosen = request.config.getoption("--bench-dir") or os.environ.get("ECTIER_BENCH_DIR")
    if chosen:
        base = Path(chosen)
        base.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix="ectier-bench-", dir=base))
        request.addfinalizer(lambda: shutil.rmtree(path, ignore_errors=True))
    else:
        path = tmp_path_factory.mktemp("ectier-bench")
    _STATE["bench_dir"] = str(path)
    return path


@pytest.fixture
def measure(benchmark, request: pytest.FixtureRequest):
    """``measure(fn, suite=, tokens=, op=, impl=, role=, bytes_per_call=, compare=(), **extra)``.

    Runs ``fn`` under pytest-benchmark (auto-calibrated rounds), groups by suite and size, stores
    the fields in ``extra_info`` (so they reach ``--benchmark-json``) and keeps the result for the
    ratio tables of the terminal summary. ``fn`` should already have been called once (warm-up:
    first-touch page faults, LMDB map growth, page cache). With ``setup=``, ``fn`` runs once per
    round for ``rounds`` rounds and ``setup()`` runs, untimed, before each.
    """

    def run(fn, *, suite: str, tokens: int, op: str, impl: str, role: str, bytes_per_call: int,
            compare: tuple[str, ...] = (), goal: bool = False, setup=None, rounds: int = 5, **extra):
        benchmark.group = f"{suite} {op.split()[0]} {size_id(tokens)}"
        info = dict(suite=suite, tokens=tokens, entry_bytes=entry_bytes(tokens), op=op, impl=impl, role=role,
                    bytes_per_call=bytes_per_call, compare=list(compare), goal=goal, **extra)
        benchmark.extra_info.update(info)
        before = report.cpu_snapshot()
        if setup is None:
            value = benchmark(fn)
        else:  # one call per round, ``setup`` (untimed) before each: e.g. evict the page cache
            value = benchmark.pedantic(fn, setup=setup, rounds=rounds, iterations=1)
        info["other_load"] = report.other_load(before, report.cpu_snapshot())
        benchmark.extra_info["other_load"] = info["other_load"]
        stats = getattr(benchmark, "stats", None)
        if stats:  # None under --benchmark-disable
            s = stats.stats
            _RESULTS.append(report.Result(info, s.median, s.min, s.rounds, request.node.name))
        return value

    return run


@pytest.fixture
def paired(benchmark, request: pytest.FixtureRequest):
    """``paired({"ectier put+get": f, "torch copy_ x2": g, ...}, suite=, tokens=, op=, bytes_per_call=)``.

    Interleaved measurement, robust to a machine whose load changes during the run: each round
    times every function once (starting with a different one each round) and the ratio
    ``t_reference / t_ectier`` is taken per round; the median of those per-round ratios is the
    "paired" ratio of the summary. The first key is the ectier side. pytest-benchmark times the
    whole round (its table shows the sum). Each function should already have been warmed up.
    """

    def run(fns: dict, *, suite: str, tokens: int, op: str, bytes_per_call: int, seconds: float = 1.5):
        names = list(fns)
        ectier = names[0]
        times: dict[str, list[float]] = {n: [] for n in names}
        counter = [0]

        def one_round():
            k = counter[0]
            counter[0] += 1
            for i in range(len(names)):
                n = names[(k + i) % len(names)]
                t0 = time.perf_counter()
                fns[n]()
                times[n].append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        one_round()
        estimate = max(time.perf_counter() - t0, 1e-6)
        for v in times.values():
            v.clear()
        counter[0] = 0
        rounds = max(7, min(500, int(seconds / estimate)))
        benchmark.group = f"{suite} paired {op} {size_id(tokens)}"
        before = report.cpu_snapshot()
        benchmark.pedantic(one_round, rounds=rounds, iterations=1)
        load = report.other_load(before, report.cpu_snapshot())
        ratios = {
            ref: statistics.median(r / e for r, e in zip(times[ref], times[ectier]))
            for ref in names[1:]
        }
        info = dict(suite=suite, tokens=tokens, entry_bytes=entry_bytes(tokens), op=op, impl=ectier, role="paired",
                    bytes_per_call=bytes_per_call, paired_ratios=ratios, paired_rounds=len(times[ectier]),
                    paired_gbps={n: bytes_per_call / statistics.median(v) / 1e9 for n, v in times.items()},
                    other_load=load)
        benchmark.extra_info.update(info)
        stats = getattr(benchmark, "stats", None)
        if stats:
            _RESULTS.append(report.Result(info, stats.stats.median, stats.stats.min, stats.stats.rounds,
                                          request.node.name))
        return ratios

    return run


# ------------------------------------------------------------------------------------ reporting


def pytest_sessionstart(session: pytest.Session) -> None:
    threads = session.config.getoption("--bench-torch-threads") or os.environ.get("ECTIER_BENCH_TORCH_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    _STATE["cpu_start"] = report.cpu_snapshot()


def _contention() -> dict:
    start = _STATE.get("cpu_start")
    return report.contention(start, report.cpu_snapshot()) if start else {}


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    machine_info["ectier"] = report.machine_info(_STATE.get("bench_dir"))
    machine_info["ectier"]["cpu contention"] = _contention()


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _NOTES:
        terminalreporter.section("ectier: notes")
        for line in _NOTES:
            terminalreporter.write_line(line)
    if not _RESULTS:
        return
    tables = report.build(_RESULTS)
    machine = report.machine_info(_STATE.get("bench_dir"))
    busy = _contention()
    machine["cpu taken by other processes during the run"] = (
        f"{busy.get('other processes')} of {busy.get('wall CPU-seconds')} CPU-seconds ({busy.get('other processes share')})"
    )
    terminalreporter.section("ectier: GB/s of ectier vs the reference, same bytes, same run")
    terminalreporter.write_line(report.render(tables, md=False, machine=machine))
    share = busy.get("other processes", 0) / max(busy.get("wall CPU-seconds", 1), 1e-9)
    if share > 0.05:
        terminalreporter.write_line(
            f"WARNING: other processes used {share:.0%} of the machine's CPU during this run; with "
            f"{os.cpu_count()} CPUs that stalls torch's multi-threaded copies (a parallel copy_ waits "
            "for a descheduled worker) - rerun on a quiet machine before quoting these figures",
            yellow=True, bold=True)
    out = config.getoption("--bench-report") or os.environ.get("ECTIER_BENCH_REPORT")
    if out:
        Path(out).write_text(report.render(tables, md=True, machine=machine) + "\n", encoding="utf-8")
        terminalreporter.write_line(f"ratio tables written to {out}")
