"""Drives vLLM 0.33 EC connectors through vLLM's own connector calls, for ``ectier bench connectors``.

Every connector (vLLM's ``ECExampleConnector``, its ``ECCPUConnector`` where CUDA is, its
``ECMooncakeConnector`` where the Mooncake client imports, and ``ECTierConnector`` in-process over
host, host over NVMe, and through ``ectier serve``) is built by
vLLM's ``ECConnectorFactory`` from a ``VllmConfig`` whose model produces ``(N, 8192)`` bfloat16
encoder outputs (a tiny Qwen2-Audio ``config.json`` with text hidden size 8192, written to a
temporary directory; nothing is downloaded), and driven with the calls vLLM's scheduler and model
runner make, in their order:

- producer (worker connector, ``ec_producer``): ``save_caches(encoder_cache, mm_hash)``, then the
  completion calls a model runner makes: ``build_connector_worker_meta`` at the end of the saving
  step, then ``start_save_caches`` + ``build_connector_worker_meta`` every later step, until the
  save is reported (ectier; vLLM's connectors report
  no saves: they count as loadable when ``save_caches`` returns, which is exact for the example
  connector's synchronous file write);
- consumer scheduler connector (``ec_consumer``): ``ensure_cache_available(request, 0)``, each
  ``False`` ending a scheduler step (``build_connector_meta``), then ``has_cache_item``,
  ``update_state_after_alloc`` and ``build_connector_meta``;
- consumer worker connector: ``bind_connector_metadata``, ``start_load_caches(encoder_cache)``,
  then every byte of the loaded tensor is copied into a preallocated ``(N, 8192)`` buffer (what the
  embedding gather does; safetensors' ``load_file`` maps the file lazily, so a load that is not
  touched costs nothing), ``build_connector_worker_meta``, ``clear_connector_metadata``;
- back on the scheduler: ``update_connector_output``, ``request_finished``.

``ECMooncakeConnector`` pushes from the producer to the consumer and needs both schedulers' connectors:
:mod:`.connector_mooncake` drives it (its own call sequence and timing meanings are there).

Each load is compared bitwise (``int16`` view) with the tensor the producer saved.

Timings (seconds, one sample per item): ``save_block_s`` (inside ``save_caches``), ``save_calls_s``
(``save_caches`` plus every completion call until the save was reported, in vLLM's order, one
model step every ``step_s`` — vLLM's worker calls them once per step; :data:`STEP_S` by
default), ``loadable_s`` (wall time from the start of ``save_caches`` until reported),
``lookup_s`` (first ``ensure_cache_available`` until ``has_cache_item`` is True, steps polled
every :data:`POLL_S`), ``load_s`` (bind + ``start_load_caches`` + touching every byte),
``consumer_s`` (the whole consumer side, lookup to ``request_finished``).

vLLM is imported when a run starts (:func:`run_variant`), never at import; ``ECTierConnector`` is
named to vLLM by its module path (``ectier_vllm.connector``), so ``ectier`` never imports the binding.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import torch

__all__ = ["VARIANTS", "WIDTH", "Variant", "run_variant", "write_model"]

#: encoder output width of the benchmark's model: Qwen3-VL-30B-A3B's 2048 * (1 + 3 deepstack levels)
WIDTH = 8192
DTYPE = torch.bfloat16
#: seconds between two scheduler steps of a deferred lookup
POLL_S = 0.0005
#: seconds between two model steps of the producer's worker (its completion calls run once per
#: step): 5 ms is a fast decode step (the model's forward alone takes longer on most deployments)
STEP_S = 0.005
#: give up on an item whose save is not reported (or whose lookup stays deferred) after this long
ITEM_TIMEOUT_S = 60.0
MiB = 1 << 20
_VLLM: SimpleNamespace | None = None


def _v() -> SimpleNamespace:
    """vLLM's names this driver calls (imported on first use, after its environment is set)."""
    global _VLLM
    if _VLLM is None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler + worker in one process
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tiny model is local; nothing may be downloaded
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
        from vllm.v1.core.sched.output import SchedulerOutput
        from vllm.v1.outputs import ECConnectorOutput

        _VLLM = SimpleNamespace(Role=ECConnectorRole, Factory=ECConnectorFactory, SchedulerOutput=SchedulerOutput,
                                ECConnectorOutput=ECConnectorOutput)
    return _VLLM
#: items saved and loaded first and left out of the samples (first-call costs: imports, arena pages)
WARMUP = 1


@dataclass(frozen=True)
class Variant:
    """One connector set-up. ``kind``: ``example`` | ``cpu`` | ``mooncake`` | ``inprocess`` | ``daemon``.
    ``nvme``: ectier keeps an NVMe tier (write-through) and the consumer opens a fresh store (in-process)
    or a restarted daemon, so every lookup promotes from NVMe."""

    name: str
    kind: str
    nvme: bool = False
    text: str = ""


VARIANTS = (
    Variant("example", "example", text="vLLM ECExampleConnector (safetensors file per item)"),
    Variant("cpu", "cpu", text="vLLM ECCPUConnector (shared CPU region; needs CUDA)"),
    Variant("mooncake", "mooncake",
            text="vLLM ECMooncakeConnector (producer pushes over Mooncake's TransferEngine: tcp on loopback, "
                 "CPU buffers; needs the Mooncake client)"),
    Variant("ectier-host", "inprocess", text="ECTierConnector in-process, host tier"),
    Variant("ectier-nvme", "inprocess", nvme=True,
            text="ECTierConnector in-process, host over NVMe (consumer reopens: served from NVMe)"),
    Variant("ectier-daemon", "daemon", text="ECTierConnector through `ectier serve` (host arena hit)"),
    Variant("ectier-daemon-nvme", "daemon", nvme=True,
            text="ECTierConnector through `ectier serve`, restarted before the loads (served from NVMe)"),
)


def write_model(directory: str, max_tokens: int) -> str:
    """A local model directory whose encoder outputs are ``(N, 8192)`` bf16 (no weights)."""
    cfg = {
        "architectures": ["Qwen2AudioForConditionalGeneration"], "model_type": "qwen2_audio",
        "audio_config": {"model_type": "qwen2_audio_encoder", "d_model": 32, "encoder_attention_heads": 2,
                         "encoder_ffn_dim": 64, "encoder_layers": 1, "num_mel_bins": 128,
                         "max_source_positions": 1500},
        "text_config": {"model_type": "qwen2", "hidden_size": WIDTH, "intermediate_size": 128,
                        "num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": 1,
                        "vocab_size": 1000, "max_position_embeddings": max(4096, 2 * max_tokens)},
        "audio_token_index": 999, "torch_dtype": "bfloat16",
    }
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return directory


def _vllm_config(model_dir: str, max_tokens: int, connector: str, role: str, extra: dict,
                 module_path: str | None, ec_kwargs: dict | None = None):
    from vllm.config import CacheConfig, ECTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    max_len = max(2048, max_tokens + 64)
    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                               max_model_len=max_len, seed=0)
    scheduler_config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_len, max_model_len=max_len,
                                       is_encoder_decoder=False, enable_chunked_prefill=True)
    cache_config = CacheConfig(block_size=16, gpu_memory_utilization=0.9, cache_dtype="auto",
                               enable_prefix_caching=False)
    ec = ECTransferConfig(ec_connector=connector, ec_role=role, ec_connector_module_path=module_path,
                          ec_connector_extra_config=extra, **(ec_kwargs or {}))
    if ec.is_ec_producer:  # what vLLM's engine measures at a producer's start-up (one dummy encode)
        ec.mm_encoder_output_widths = {"audio": WIDTH}
    return VllmConfig(model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config,
                      ec_transfer_config=ec)


def _request(req_id: str, mm_hash: str, n: int, ec_params: dict | None = None):
    """A request with one ``n``-token audio item ``mm_hash``; ``ec_params``: its ``ec_transfer_params``
    (what a disaggregation proxy passes in the sampling params' ``extra_args``)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    feat = MultiModalFeatureSpec(data=None, modality="audio", identifier=mm_hash,
                                 mm_position=PlaceholderRange(offset=1, length=n))
    return Request(request_id=req_id, prompt_token_ids=[1] * (n + 2), sampling_params=SamplingParams(max_tokens=1, extra_args=(
                   {"ec_transfer_params": ec_params} if ec_params else None)),
                   pooling_params=None, mm_features=[feat])


class _Daemon:
    """``python -m ectier.daemon`` on a socket in a private directory; ``restart`` keeps its NVMe store."""

    def __init__(self, directory: str, host_bytes: int, nvme: bool) -> None:
        self.dir = directory
        self.socket_path = os.path.join(directory, "d.sock")
        # the arena file where a deployment has it (the daemon's default shm_dir, a tmpfs): a
        # MAP_SHARED file on a disk filesystem would be written back to the disk under the puts
        self.shm_dir = _shm_dir()
        cfg: dict[str, Any] = {
            "namespace": "bench",
            "host": {"capacity_bytes": host_bytes, "block_bytes": 256 * 1024, "admit_wait_s": 0.5},
            "daemon": {"socket_path": self.socket_path, "shm_dir": self.shm_dir or directory},
        }
        if nvme:
            cfg["nvme"] = {"path": os.path.join(directory, "nvme"), "capacity_bytes": 2 * host_bytes + 64 * MiB,
                           "sync": False, "write_through": True, "flush_on_close": True}
        self.config_path = os.path.join(directory, "daemon.json")
        with open(self.config_path, "w") as f:
            json.dump(cfg, f)
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> "_Daemon":
        from ectier.daemon.client import DaemonClient

        log = open(os.path.join(self.dir, "daemon.log"), "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "ectier.daemon", "--config", self.config_path],
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ectier daemon exited with {self.proc.returncode}; see {self.dir}/daemon.log")
            try:
                with DaemonClient(self.socket_path, timeout_s=2.0, connect_retry_s=0.1) as c:
                    c.ping()
                return self
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"ectier daemon not ready after {timeout_s} s") from None
                time.sleep(0.05)

    def remove(self) -> None:
        """Remove the private directory under /dev/shm (after :meth:`stop`)."""
        if self.shm_dir is not None:
            shutil.rmtree(self.shm_dir, ignore_errors=True)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _shm_dir() -> str | None:
    """A new private directory under ``/dev/shm`` (``None`` where there is none to write)."""
    if not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)):
        return None
    return tempfile.mkdtemp(prefix="ectier-bench-shm-", dir="/dev/shm")


@dataclass
class _Setup:
    """The connectors of one (variant, N) run and what to tear down."""

    variant: Variant
    connector: str
    module_path: str | None
    extra: dict
    ec_kwargs: dict = field(default_factory=dict)
    cleanup: list[Callable[[], None]] = field(default_factory=list)
    daemon: _Daemon | None = None


def _setup(v: Variant, directory: str, store_bytes: int) -> _Setup:
    if v.kind == "example":
        return _Setup(v, "ECExampleConnector", None, {"shared_storage_path": os.path.join(directory, "example")})
    if v.kind == "cpu":  # it refuses the V1 model runner (VllmConfig.use_v2_model_runner reads this)
        before = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        s = _Setup(v, "ECCPUConnector", None, {})
        s.cleanup.append(lambda: os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None) if before is None
                         else os.environ.__setitem__("VLLM_USE_V2_MODEL_RUNNER", before))
        return s
    if v.kind == "mooncake":
        from .connector_mooncake import ec_settings

        kwargs, undo = ec_settings(store_bytes)
        s = _Setup(v, "ECMooncakeConnector", None, {"mooncake_protocol": "tcp"}, ec_kwargs=kwargs)
        s.cleanup += undo
        return s
    host = {"capacity_bytes": store_bytes, "block_bytes": 256 * 1024}
    if v.kind == "inprocess":
        extra: dict[str, Any] = {"mode": "inprocess", "namespace": "bench", "host": host}
        if v.nvme:
            extra["nvme"] = {"path": os.path.join(directory, "nvme"), "capacity_bytes": 2 * store_bytes + 64 * MiB,
                             "sync": False, "write_through": True}
        return _Setup(v, "ECTierConnector", "ectier_vllm.connector", extra)
    d = tempfile.mkdtemp(prefix="ectier-bench-d", dir="/tmp")  # AF_UNIX paths: short
    daemon = _Daemon(d, store_bytes, v.nvme)
    try:
        daemon.start()
    except BaseException:
        daemon.remove()
        shutil.rmtree(d, ignore_errors=True)
        raise
    s = _Setup(v, "ECTierConnector", "ectier_vllm.connector",
               {"mode": "daemon", "socket_path": daemon.socket_path, "namespace": "bench"}, daemon=daemon)
    s.cleanup += [daemon.stop, daemon.remove, lambda: shutil.rmtree(d, ignore_errors=True)]
    return s


def skip_reason(v: Variant) -> str | None:
    """Why ``v`` cannot run on this machine (``None``: it can)."""
    if v.kind == "cpu" and not torch.cuda.is_available():
        return ("ECCPUConnector needs CUDA (its worker copies between the GPU encoder cache and a pinned "
                "shared CPU region, and it requires the V2 model runner); torch.cuda.is_available() is False")
    if v.kind == "mooncake":
        from .connector_mooncake import skip_reason as mooncake_skip_reason

        return mooncake_skip_reason()
    return None


def _make(setup: _Setup, model_dir: str, max_tokens: int, role: str, which: str):
    cfg = _vllm_config(model_dir, max_tokens, setup.connector, role, setup.extra, setup.module_path, setup.ec_kwargs)
    return _v().Factory.create_connector(cfg, getattr(_v().Role, which))


def _device() -> str:
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _produce(producer, mm_hash: str, tensor: torch.Tensor, synchronous: bool, step_s: float) -> dict[str, float]:
    """Save one item as a model step does, then one model step every ``step_s`` until the save is
    reported; returns save_block_s, save_calls_s, loadable_s, completion_calls.

    vLLM's order within a step (``ec_connector_model_runner_mixin``): ``start_save_caches``
    before the encoder, ``save_caches`` per item it encoded, ``build_connector_worker_meta``
    after. So the step that saves the item calls ``build_connector_worker_meta`` right after
    ``save_caches`` (its ``start_save_caches`` came before the save: not this item's), and each
    later step calls ``start_save_caches`` + ``build_connector_worker_meta``."""
    cache = {mm_hash: tensor}
    t0 = time.perf_counter()
    producer.save_caches(cache, mm_hash)
    t1 = time.perf_counter()
    blocked, polls = t1 - t0, 0
    if synchronous:
        return {"save_block_s": blocked, "save_calls_s": blocked, "loadable_s": t1 - t0, "completion_calls": 0}
    while True:
        c0 = time.perf_counter()
        if polls:  # a later step: its start comes first
            producer.start_save_caches()
        meta = producer.build_connector_worker_meta()
        c1 = time.perf_counter()
        blocked += c1 - c0
        polls += 1
        if meta is not None and (mm_hash in getattr(meta, "saved", ()) or mm_hash in getattr(meta, "save_failed", ())):
            if mm_hash in meta.save_failed:
                raise RuntimeError(f"{producer.__class__.__name__}: saving {mm_hash} failed")
            return {"save_block_s": t1 - t0, "save_calls_s": blocked, "loadable_s": c1 - t0, "completion_calls": polls}
        if c1 - t0 > ITEM_TIMEOUT_S:
            raise RuntimeError(f"{producer.__class__.__name__}: save of {mm_hash} not reported after {ITEM_TIMEOUT_S} s")
        time.sleep(step_s)


def _consume(sched, worker, req, mm_hash: str, dst: torch.Tensor) -> dict[str, float]:
    """The consumer side of one item (see the module docstring); returns its timings."""
    t0 = time.perf_counter()
    steps = 1
    while not sched.ensure_cache_available(req, 0):
        sched.build_connector_meta(_v().SchedulerOutput.make_empty())  # the step ends with the request deferred
        steps += 1
        if time.perf_counter() - t0 > ITEM_TIMEOUT_S:
            raise RuntimeError(f"{sched.__class__.__name__}: {mm_hash} still deferred after {ITEM_TIMEOUT_S} s")
        time.sleep(POLL_S)
    if not sched.has_cache_item(mm_hash):
        raise RuntimeError(f"{sched.__class__.__name__}: has_cache_item({mm_hash}) is False for a saved item")
    t1 = time.perf_counter()
    sched.update_state_after_alloc(req, 0)
    meta = sched.build_connector_meta(_v().SchedulerOutput.make_empty())
    t2 = time.perf_counter()
    encoder_cache: dict[str, torch.Tensor] = {}
    worker.bind_connector_metadata(meta)
    worker.start_load_caches(encoder_cache)
    dst.copy_(encoder_cache[mm_hash])  # touch every byte (a lazily mapped file is read here)
    _sync()
    t3 = time.perf_counter()
    wmeta = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    sched.update_connector_output(_v().ECConnectorOutput(ec_connector_worker_meta=wmeta))
    sched.request_finished(req)
    t4 = time.perf_counter()
    return {"lookup_s": t1 - t0, "lookup_steps": steps, "load_s": t3 - t2, "consumer_s": t4 - t0}


def _shutdown(*conns) -> None:
    for c in conns:
        if c is not None:
            c.shutdown()


def run_variant(v: Variant, n: int, reps: int, workdir: str | None = None,
                advance: Callable[[int], None] | None = None, step_s: float = STEP_S) -> dict[str, Any]:
    """Run ``reps`` items of ``(n, 8192)`` bf16 through variant ``v``; the producer's model steps
    (completion calls) come every ``step_s`` seconds.

    Returns:
        ``{"variant", "num_tokens", "nbytes", "reps", "samples": [{timings...}, ...],
        "mismatches": int}``; ``{"variant", "num_tokens", "skipped": reason}`` where it cannot run
        (:func:`skip_reason`, or the connector refused to start: the reason is its error; for
        ``mooncake``, an error starting its connectors).

    Raises:
        RuntimeError: a save never reported, a saved item never loadable (the benchmark's own
            checks; a bitwise mismatch is counted, not raised).
    """
    _v()  # vLLM's environment first
    reason = skip_reason(v)
    if reason:
        return {"variant": v.name, "num_tokens": n, "skipped": reason}
    nbytes = n * WIDTH * 2
    directory = tempfile.mkdtemp(prefix="ectier-bench-conn-", dir=workdir)
    model_dir = write_model(os.path.join(directory, "model"), n)
    setup: _Setup | None = None
    producer = sched = worker = mc = None
    try:
        setup = _setup(v, directory, (reps + WARMUP) * nbytes + 16 * MiB)
        if v.kind == "mooncake":  # four connectors, pushing: see .connector_mooncake
            from .connector_mooncake import MooncakeConnectors

            mc = MooncakeConnectors(lambda role, which: _make(setup, model_dir, n, role, which), n,
                                    f"tcp://127.0.0.1:{setup.ec_kwargs['ec_port']}")
        else:
            producer = _make(setup, model_dir, n, "ec_producer", "WORKER")
        sync_save = setup.connector != "ECTierConnector"  # vLLM's: loadable once save_caches returns
        dev = _device()
        base = torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(n)).to(DTYPE).to(dev)
        items, samples = [], []
        for r in range(reps + WARMUP):
            mm_hash = f"bench-{v.name}-{n}-{r}-{os.getpid()}"
            t = base.clone()
            t[0, 0] = float(r)
            _sync()
            samples.append(mc.produce(mm_hash, t, step_s) if mc else _produce(producer, mm_hash, t, sync_save, step_s))
            items.append((mm_hash, t.cpu()))
            del t
        if v.nvme:  # the consumer finds the items on NVMe only
            _shutdown(producer)
            producer = None
            if setup.daemon is not None:
                setup.daemon.stop()
                setup.daemon.start()
        if mc is None:
            sched = _make(setup, model_dir, n, "ec_consumer", "SCHEDULER")
            worker = _make(setup, model_dir, n, "ec_consumer", "WORKER")
        dst = torch.empty(n, WIDTH, dtype=DTYPE, device=dev)
        mismatches = 0
        for r, (mm_hash, ref) in enumerate(items):
            samples[r].update(mc.consume(f"req-{r}", mm_hash, dst) if mc else
                              _consume(sched, worker, _request(f"req-{r}", mm_hash, n), mm_hash, dst))
            if not torch.equal(dst.cpu().view(torch.int16), ref.view(torch.int16)):
                mismatches += 1
            if advance and r >= WARMUP:
                advance(1)
        return {"variant": v.name, "num_tokens": n, "nbytes": nbytes, "reps": reps, "samples": samples[WARMUP:],
                "mismatches": mismatches}
    except Exception as exc:
        # vLLM's own connector refused this machine (ECCPUConnector; ECMooncakeConnector's start,
        # e.g. Mooncake's engine): say why, measure the rest
        if v.kind == "cpu" or (v.kind == "mooncake" and mc is None and setup is not None):
            return {"variant": v.name, "num_tokens": n, "skipped": f"{type(exc).__name__}: {exc}"}
        raise
    finally:
        _shutdown(producer, sched, worker)
        if mc is not None:
            mc.shutdown()
        for fn in (setup.cleanup if setup else ()):
            fn()
        shutil.rmtree(directory, ignore_errors=True)
