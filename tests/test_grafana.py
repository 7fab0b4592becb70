"""docs/grafana/ectier.json, the Grafana dashboard of the daemon's and the connector's metrics:
every PromQL query names only metrics the code exports.

The exported names are collected from the code, not from a list kept here:

- the daemon's: a real :class:`~ectier.daemon.server.DaemonServer` (host and NVMe tiers, metrics
  on an ephemeral port) is started in-process, served one put and one get, and its ``/metrics``
  page is parsed with prometheus-client's own parser;
- the connector's (``vllm:ectier_*``, bindings/ectier_vllm/metrics.py, which imports vLLM): its
  ``PROM_COUNTERS`` and ``PROM_LOAD_SECONDS`` definitions are read with ``ast`` and registered as
  prometheus-client ``Counter`` / ``Histogram`` objects in a fresh registry, as vLLM does, whose
  sample names are collected.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import tempfile
import threading
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docs" / "grafana" / "ectier.json"
CONNECTOR_METRICS = ROOT / "bindings" / "ectier_vllm" / "metrics.py"
MiB = 1 << 20

#: PromQL words that are not metric names (keywords, set operators, modifiers).
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan", "atan2"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, label names and values, ranges,
    keywords and Grafana variables left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges, subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.:$])([A-Za-z_:][\w:]*)(\s*\()?", text):
        name, call = m.group(1), m.group(2)
        if call is None and name not in _KEYWORDS:
            names.add(name)
    return names


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def _panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out += p.get("panels", [])  # panels inside collapsed rows
    return out


def _queries(dash: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    out = [(f"panel {p['title']!r}", t["expr"]) for p in _panels(dash) for t in p.get("targets", [])]
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"\s*label_values\(\s*(.+?)\s*,\s*\w+\s*\)\s*", q)
            assert m, f"variable {var['name']}: expected label_values(<selector>, <label>), got {q!r}"
            out.append((f"variable {var['name']!r}", m.group(1)))
    return out


# ------------------------------------------------------------------ what the code exports


def _daemon_metric_names() -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    from ectier.config import CacheConfig
    from ectier.daemon.client import DaemonClient
    from ectier.daemon.server import DaemonServer

    d = tempfile.mkdtemp(prefix="ectg", dir="/tmp")  # short: a Unix socket path is at most 107 bytes
    server = thread = None
    try:
        cfg = CacheConfig.from_dict({
            "namespace": "grafana",
            "host": {"capacity_bytes": 4 * MiB, "block_bytes": 64 * 1024, "pin_memory": False},
            "nvme": {"path": f"{d}/nvme", "capacity_bytes": 16 * MiB, "map_initial_bytes": 4 * MiB},
            "daemon": {"socket_path": f"{d}/d.sock", "shm_dir": d, "metrics_port": 0},
        })
        server = DaemonServer(cfg)
        server.start()
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        import torch

        with DaemonClient(server.socket_path, client_name="grafana-test") as client:
            client.put("k", torch.zeros(1024, dtype=torch.uint8))
            assert client.get("k") is not None
            host, port = server.metrics_address
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as resp:
                text = resp.read().decode()
        return {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    finally:
        if server is not None:
            server.stop()
        if thread is not None:
            thread.join(timeout=30)
        shutil.rmtree(d, ignore_errors=True)


def _module_constant(tree: ast.Module, name: str):
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{CONNECTOR_METRICS}: no constant {name}")


def _connector_metric_names() -> set[str]:
    from prometheus_client import CollectorRegistry, Counter, Histogram

    tree = ast.parse(CONNECTOR_METRICS.read_text(encoding="utf-8"))
    counters = _module_constant(tree, "PROM_COUNTERS")
    histogram = _module_constant(tree, "PROM_LOAD_SECONDS")
    buckets = _module_constant(tree, "LOAD_BUCKETS")
    labels = ["model_name", "engine"]
    reg = CollectorRegistry()
    for name, (_key, doc) in counters.items():
        Counter(name, doc, labels, registry=reg).labels("m", "0").inc()
    Histogram(histogram, "load seconds", labels, buckets=buckets, registry=reg).labels("m", "0").observe(0.001)
    return {s.name for fam in reg.collect() for s in fam.samples}


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return _daemon_metric_names() | _connector_metric_names()


# ---------------------------------------------------------------------------------- tests


def test_promql_metric_names_finds_metrics_and_nothing_else():
    expr = ('histogram_quantile(0.99, sum by (le) (rate(vllm:ectier_load_seconds_bucket{model_name=~"$m"}'
            '[$__rate_interval]))) / ignoring(tier) group_left() clamp_min(sum(ectier_x{job="a b"}), 1e-9)'
            ' + on(tier) ectier_y offset 5m and bool ectier_z')
    assert promql_metric_names(expr) == {"vllm:ectier_load_seconds_bucket", "ectier_x", "ectier_y", "ectier_z"}


def test_the_exported_names_are_collected_from_the_code(exported):
    assert {"ectier_lookups_total", "ectier_tier_hits_total", "ectier_tier_used_bytes",
            "ectier_checksum_failures_total", "ectier_clients"} <= exported
    assert {"vllm:ectier_hits_total", "vllm:ectier_load_seconds_bucket", "vllm:ectier_load_seconds_count"} <= exported
    assert "ectier_no_such_metric" not in exported


def test_every_dashboard_query_names_only_exported_metrics(exported):
    queries = _queries(_dashboard())
    assert len(queries) >= 20
    unknown = []
    for where, expr in queries:
        names = promql_metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        unknown += [f"{where}: {n}" for n in sorted(names - exported)]
    assert unknown == [], "metrics the code does not export"


def test_a_panel_naming_an_unknown_metric_is_caught(exported):
    dash = _dashboard()
    first = next(p for p in _panels(dash) if p.get("targets"))
    first["targets"][0]["expr"] = first["targets"][0]["expr"].replace("ectier_", "ectier_typo_", 1)
    names = set().union(*(promql_metric_names(e) for _, e in _queries(dash)))
    assert names - exported, "a misspelt metric must not pass"


def test_the_dashboard_shows_what_operators_need():
    """Hit rate, reads per tier, bytes per tier, evictions and demotions, checksum failures, load latency."""
    dash = _dashboard()
    used = set().union(*(promql_metric_names(e) for _, e in _queries(dash)))
    for name in ("ectier_tier_hits_total", "ectier_lookups_total", "ectier_tier_used_bytes",
                 "ectier_tier_capacity_bytes", "ectier_tier_evictions_total", "ectier_demotions_total",
                 "ectier_checksum_failures_total", "vllm:ectier_load_seconds_bucket", "vllm:ectier_hits_total"):
        assert name in used, name
    panels = [p for p in _panels(dash) if p["type"] != "row"]
    assert len({p["id"] for p in _panels(dash)}) == len(_panels(dash)), "panel ids must be unique"
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert all(t["refId"] for t in p["targets"]), p["title"]
    assert any(v["type"] == "datasource" and v["name"] == "datasource" for v in dash["templating"]["list"])


def test_operations_and_vllm_docs_point_at_the_dashboard():
    for doc in ("operations.md", "vllm.md"):
        assert "grafana/ectier.json" in (ROOT / "docs" / doc).read_text(encoding="utf-8"), doc


def test_no_panel_divides_the_tiers_reads_by_the_gets():
    """A tier's ``hits`` counts the reads it served, a prefetch's read too (``get`` of a prefetched
    NVMe entry: one get, two tier reads; tests/test_prefetch_into_host.py), so the tiers' hits add
    up to more than the gets. Before: the panel "Hit rate by tier" divided them by
    ``ectier_lookups_total`` as "share of gets served by each tier", and with the daemon's
    prefetches (vLLM's daemon mode) host and NVMe each showed ~100 %."""
    for where, expr in _queries(_dashboard()):
        names = promql_metric_names(expr)
        assert not {"ectier_tier_hits_total", "ectier_lookups_total"} <= names, where
