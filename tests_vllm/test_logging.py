"""What the connector says reaches vLLM's log: its own lines go through a logger under ``vllm``
(vLLM configures only its own: the start-up line docs/vllm.md tells operators to look for was
dropped, found by a newcomer run, 2026-12-07), ectier's core loggers use vLLM's handler when the
process configured nothing else, and ``ECTIER_*`` variables, which the connector does not read,
are named in a warning instead of being ignored silently."""

from __future__ import annotations

import logging
import os

import pytest

import harness as H

NS = "logging-test"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _extra(tmp_path) -> dict:
    return {"namespace": NS, "host": {"capacity_bytes": "4MiB", "block_bytes": "64KiB", "pin_memory": False}}


def _connector(model_dir, tmp_path):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier_vllm.connector import ECTierConnector

    return ECTierConnector(H.make_vllm_config(model_dir, "ec_both", _extra(tmp_path)), ECConnectorRole.SCHEDULER)


@pytest.fixture
def vllm_records():
    """A handler on vLLM's own logger (it does not propagate): what vLLM's handler would write."""
    handler, vllm_logger = _Records(), logging.getLogger("vllm")
    vllm_logger.addHandler(handler)
    level = vllm_logger.level
    vllm_logger.setLevel(logging.INFO)
    try:
        yield handler.records
    finally:
        vllm_logger.removeHandler(handler)
        vllm_logger.setLevel(level)


def test_the_start_up_line_reaches_vllms_logger(model_dir, tmp_path, vllm_records, monkeypatch):
    for name in [n for n in os.environ if n.startswith("ECTIER_")]:
        monkeypatch.delenv(name)
    c = _connector(model_dir, tmp_path)
    try:
        lines = [r.getMessage() for r in vllm_records]
        assert any(m.startswith("ECTierConnector (scheduler, ec_both): namespace 'logging-test'") for m in lines), lines
        assert not any("not read by the vLLM connector" in m for m in lines)
    finally:
        c.shutdown()


def test_ectier_variables_are_named_as_not_read(model_dir, tmp_path, vllm_records, monkeypatch):
    monkeypatch.setenv("ECTIER_HOST__CAPACITY_BYTES", "32MiB")
    c = _connector(model_dir, tmp_path)
    try:
        warned = [r.getMessage() for r in vllm_records if r.levelno == logging.WARNING]
        assert any("ECTIER_HOST__CAPACITY_BYTES set in the environment but not read by the vLLM connector" in m
                   for m in warned), warned
    finally:
        c.shutdown()


def test_core_logs_use_vllms_handler_when_nothing_else_would(monkeypatch):
    from ectier_vllm.common import route_core_logs

    core, vllm_logger, handler = logging.getLogger("ectier"), logging.getLogger("vllm"), _Records()
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # (pytest's own capture handlers aside)
    monkeypatch.setattr(core, "handlers", [])
    monkeypatch.setattr(vllm_logger, "handlers", [handler])
    monkeypatch.setattr(core, "level", logging.NOTSET)
    route_core_logs()
    logging.getLogger("ectier.tiers.nvme").info("nvme tier: opened")
    assert [r.getMessage() for r in handler.records] == ["nvme tier: opened"]
    monkeypatch.setattr(core, "handlers", [])
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.NullHandler()])  # the process logs itself
    route_core_logs()
    assert core.handlers == []
