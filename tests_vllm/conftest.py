"""Fixtures of the vLLM suite: a tiny local model dir, scheduler/worker factories, clean registry."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vllm is imported (no GPU in CI)
# scheduler and worker in one process, as vLLM's uniproc executor runs them on a one-GPU engine
# (vLLM's CPU platform would otherwise switch the executor to "mp")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may be downloaded at test time
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest

import harness as H


@pytest.fixture
def model_dir(tmp_path):
    return H.write_tiny_model(str(tmp_path / "model"))


@pytest.fixture(params=["v1", "v2"], ids=["runner-v1", "runner-v2"])
def engine(model_dir, monkeypatch, request):
    """``engine(role, extra)`` -> (scheduler, worker): one vLLM engine's two EC connectors, with
    the worker driven as the V1 and (second run of each test) the V2 model runner drives it."""
    made = []
    # the property both vLLM's workers and the connector read to know which runner runs
    # (VllmConfig.use_v2_model_runner)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if request.param == "v2" else "0")

    def make(role, extra, **config):
        cfg = H.make_vllm_config(model_dir, role, extra, **config)
        sched = H.make_scheduler(cfg, monkeypatch)
        worker = H.Worker(cfg, runner=request.param)
        made.append((sched, worker))
        return sched, worker

    yield make
    for sched, worker in made:
        worker.connector.shutdown()
        sched.ec_connector.shutdown()
    from vllm.distributed.ec_transfer import ec_transfer_state

    ec_transfer_state.ensure_ec_transfer_shutdown()
    from ectier_vllm.store import open_stores

    assert open_stores() == 0, "an in-process store outlived every connector"


def run_step(sched, worker):
    """One engine step: schedule, execute on the worker, update the scheduler. Returns both outputs."""
    so = sched.schedule()
    out = worker.execute(so)
    engine_out = sched.update_from_output(so, out)
    return so, engine_out


@pytest.fixture
def daemon():
    """A started ``ectier serve`` process (8 MiB host arena over NVMe, daemon_helpers.daemon_config)
    in a fresh directory; stopped and the directory removed after the test."""
    from daemon_helpers import DaemonProcess, daemon_config, remove_dir, short_tmpdir, write_config

    d = short_tmpdir()
    cfg = daemon_config(d, host_bytes=8 << 20, namespace="unused-default")
    proc = DaemonProcess(write_config(os.path.join(d, "daemon.json"), cfg), cfg["daemon"]["socket_path"])
    proc.launch().wait_ready()
    try:
        yield proc
    finally:
        proc.stop()
        remove_dir(d)


@pytest.fixture
def cache_hooks():
    """``cache_hooks(engine, gpu=False)``: every in-process TieredCache opened afterwards routes its
    copies through ``engine`` (``ectier.testing.make_cache``); ``gpu=True`` also puts the GPU
    tier's arena in CPU memory (``gpu_device="cpu"``), so the worker's device ("cpu" here)
    is the GPU tier's device. Request this fixture after ``engine``: it completes deferred copies
    before the connectors shut down (shutdown waits for them)."""
    import functools

    import contextlib

    from connector_helpers import Engine
    from ectier import testing
    from ectier_vllm import testing as ct

    engines = []
    with contextlib.ExitStack() as factories:

        def set_hooks(copy_engine, gpu=False):
            engines.append(copy_engine)
            factory = functools.partial(testing.make_cache, copy_engine=copy_engine, gpu_device="cpu" if gpu else None)
            factories.enter_context(ct.cache_factory(factory))
            return copy_engine

        yield set_hooks
        for e in engines:
            if isinstance(e, Engine):
                e.auto = True
                e.complete()
