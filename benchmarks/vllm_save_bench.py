"""Worker time blocked by a producer's saves through ``ECTierConnector`` (issue 14, item 2).

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=.:bindings .venv-vllm/bin/python benchmarks/vllm_save_bench.py \
        [--tokens 64,1024,2040] [--items 20]

For each mode (in-process host tier; in-process host + NVMe with ``write_through``; daemon with a
host tier; daemon with NVMe ``write_through``) and size ``(N, 8192)`` bf16 it times, per item, what
the model runner's thread spends in ``save_caches`` plus the save's completion calls
(``build_connector_worker_meta``, which polls and reports finished saves), and, in the same run,
the store's own put of the same bytes (``TieredCache.put`` + wait, ``DaemonClient.put``): what the
worker waited for before saves moved to the background thread. The tensors are made first; before
each timed call the benchmark pauses ``--idle-s`` (torch's intra-op threads, which spin for a while
after an operation, would otherwise compete with the two threads for the CPUs); between items it
waits for the background put outside the timed region (the queue never fills) and checks it
committed. A second figure: 8 saves back to back, as one step saving 8 items, then the report,
per item. Prints a markdown table (median and p90, microseconds per item) and exits. Goal: <= 100 us per item on CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests_vllm"))

import torch  # noqa: E402

import harness as H  # noqa: E402  (tests_vllm/harness.py: a tiny local model config, no download)

WIDTH = 8192


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _worker(model_dir: str, extra: dict):
    from vllm.distributed.ec_transfer import ec_transfer_state

    cfg = H.make_vllm_config(model_dir, "ec_producer", extra)
    ec_transfer_state.ensure_ec_transfer_shutdown()
    ec_transfer_state.ensure_ec_transfer_initialized(cfg)
    return ec_transfer_state.get_ec_transfer()


def _measure(conn, reference, n: int, items: int, tag: str, idle_s: float):
    tensors = {f"{tag}-{n}-{i}".ljust(64, "x"): torch.randn(n, WIDTH).to(torch.bfloat16) for i in range(items)}
    blocked, ref = [], []
    for key, tensor in tensors.items():
        time.sleep(idle_s)  # torch's intra-op threads stop spinning (they would compete for the CPUs)
        t0 = time.perf_counter()
        conn.save_caches({key: tensor}, key)
        conn.build_connector_worker_meta()
        blocked.append(time.perf_counter() - t0)
        assert conn.saves.wait(60)
        meta = conn.build_connector_worker_meta()
        assert meta is not None and meta.saved == [key], "the save failed"
    for key, tensor in tensors.items():
        time.sleep(idle_s)
        t0 = time.perf_counter()
        reference(f"ref-{key}"[:64], tensor)
        ref.append(time.perf_counter() - t0)
    # a step that saves 8 items back to back, then reports: time per item
    burst = []
    for r in range(3):
        keys = [f"b{r}-{k}"[:64] for k in list(tensors)[:8]]
        time.sleep(idle_s)
        t0 = time.perf_counter()
        for key, tensor in zip(keys, tensors.values()):
            conn.save_caches({key: tensor}, key)
        conn.build_connector_worker_meta()
        burst.append((time.perf_counter() - t0) / len(keys))
        assert conn.saves.wait(120)
        conn.build_connector_worker_meta()
    return blocked, ref, burst


def _daemon(tmp: str, write_through: bool, host_bytes: int):
    sock = os.path.join(tmp, "d.sock")
    cfg = os.path.join(tmp, "daemon.yaml")
    with open(cfg, "w") as f:
        f.write(f"host: {{capacity_bytes: {host_bytes}, pin_memory: false}}\n"
                + (f"nvme: {{path: {tmp}/nvme, capacity_bytes: {8 * host_bytes}, write_through: true}}\n"
                   if write_through else "")
                + f"daemon: {{socket_path: {sock}, shm_dir: {tmp}}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "ectier.daemon", "--config", cfg, "--log-level", "warning"])
    deadline = time.monotonic() + 30
    while not os.path.exists(sock):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("the daemon did not start")
        time.sleep(0.05)
    return proc, sock


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="64,1024,2040", help="entry sizes as N tokens of (N, 8192) bf16")
    ap.add_argument("--items", type=int, default=20, help="items saved per mode and size")
    ap.add_argument("--idle-s", type=float, default=0.2, help="pause before each timed call (seconds)")
    args = ap.parse_args(argv)
    sizes = [int(t) for t in args.tokens.split(",")]
    host_bytes = max(256 << 20, 4 * args.items * max(sizes) * WIDTH * 2)
    from ectier.daemon.client import DaemonClient

    rows = []
    with tempfile.TemporaryDirectory(prefix="ectvs", dir="/tmp") as tmp:
        model_dir = H.write_tiny_model(os.path.join(tmp, "model"))
        for mode in ("inprocess host", "inprocess host+nvme write_through", "daemon host", "daemon nvme write_through"):
            sub = tempfile.mkdtemp(dir=tmp)
            proc = None
            if mode.startswith("daemon"):
                proc, sock = _daemon(sub, "nvme" in mode, host_bytes)
                extra = {"mode": "daemon", "socket_path": sock, "namespace": "bench"}
                client = DaemonClient(sock)
                reference = lambda k, t: client.put(k, t, namespace="bench")  # noqa: E731
            else:
                extra = {"namespace": "bench", "host": {"capacity_bytes": host_bytes, "pin_memory": False}}
                if "nvme" in mode:
                    extra["nvme"] = {"path": os.path.join(sub, "nvme"), "capacity_bytes": 8 * host_bytes,
                                     "write_through": True}
            conn = _worker(model_dir, extra)
            if proc is None:
                cache = conn._store.cache  # the connector's own TieredCache: same tiers for the reference
                reference = lambda k, t: cache.put(k, t).wait()  # noqa: E731
            try:
                for n in sizes:
                    blocked, ref, burst = _measure(conn, reference, n, args.items, mode.split()[0][:2], args.idle_s)
                    rows.append((mode, n, statistics.median(blocked), _p(blocked, 0.9),
                                 statistics.median(burst), statistics.median(ref), _p(ref, 0.9)))
            finally:
                conn.shutdown()
                if proc is not None:
                    client.close()
                    proc.terminate()
                    proc.wait(30)
    print("| mode | N (MiB) | blocked p50 µs | blocked p90 µs | 8 in a step, µs/item | sync put p50 µs "
          "| sync put p90 µs | put / blocked |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, n, b50, b90, burst, r50, r90 in rows:
        print(f"| {mode} | {n} ({n * WIDTH * 2 / 2**20:.0f}) | {b50 * 1e6:.0f} | {b90 * 1e6:.0f} | {burst * 1e6:.0f} | "
              f"{r50 * 1e6:.0f} | {r90 * 1e6:.0f} | {r50 / b50:.0f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
