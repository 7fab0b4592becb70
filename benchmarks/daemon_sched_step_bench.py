"""Daemon mode: the scheduler-side cost of one step that loads 8 items (issue 14, item 3).

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=$PWD:$PWD/bindings /work/main/.venv-vllm/bin/python \
        benchmarks/daemon_sched_step_bench.py [--steps 300] [--items 8] [--mib 1] [--nvme]

Starts a daemon (host tier only; ``--nvme``: over an NVMe tier) with ``--items`` entries of
``(64 * mib, 8192)`` bf16 (``--mib`` MiB each), and drives the
scheduler role of ``ECTierConnector`` (daemon mode) as vLLM's scheduler does in a step that finds
a request's items in the store: ``ensure_cache_available``, ``has_cache_item`` and
``update_state_after_alloc`` per item, ``build_connector_meta``; then, as vLLM's
``update_from_output`` does once the worker reported the step's loads, ``update_connector_output``
(the pins are dropped) and ``request_finished``. No worker runs (its reads are not the scheduler's cost). A new request for
the same items arrives once the last one was loadable; a step whose lookup is not answered yet
defers it (``ensure_cache_available`` is False, asked again next step, as vLLM does). Every step's
wall time over all those calls is one sample, 2 ms between steps (a model step). Prints p50, p90,
p99 and max in ms, and how many steps and ms a request waited until loadable. With ``--nvme``
requests take turns over four groups of ``--items`` entries, and the arena holds about two
groups: every request finds its items on NVMe only (evicted since its group's last turn), so the
daemon promotes them while the scheduler's steps go on. The heap is frozen after the set-up
(vLLM's ``freeze_gc_heap``, as its engine core does once started). Goal (issue 14): p99 <= 0.5 ms
for 8 items, whatever the entry size and the tier holding it.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time

import torch


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--items", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--mib", type=int, default=1, help="MiB per entry: (64 * mib, 8192) bf16")
    ap.add_argument("--nvme", action="store_true", help="entries held on NVMe only when asked (see above)")
    ap.add_argument("--wait-s", type=float, default=None,
                    help="the connector's daemon_answer_wait_s (default: the connector's default)")
    return ap.parse_args()


def _store_groups(socket_path: str, groups: list[list[str]], rows: int) -> None:
    """Put every group's entries, ``(rows, 8192)`` bf16, each filled with its own number."""
    from ectier.daemon.client import DaemonClient

    n = len(groups[0])
    with DaemonClient(socket_path) as c:
        for g, group in enumerate(groups):
            for i, h in enumerate(group):
                c.put(h, torch.full((rows, 8192), float(g * n + i), dtype=torch.bfloat16), namespace="bench")


def _request(step: int, hashes: list[str], rows: int):
    """A request whose items are ``hashes``, ``rows`` tokens each, one after the other."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    feats = [MultiModalFeatureSpec(data=None, modality="audio", identifier=h,
                                   mm_position=PlaceholderRange(offset=1 + i * rows, length=rows))
             for i, h in enumerate(hashes)]
    return Request(request_id=f"r{step}", prompt_token_ids=[1] * (rows * len(hashes) + 2),
                   sampling_params=SamplingParams(max_tokens=1), pooling_params=None, mm_features=feats)


def _run_steps(v, sched, groups: list[list[str]], rows: int, args: argparse.Namespace) -> dict[str, list]:
    """Scheduler steps until ``args.steps`` samples (after ``args.warmup``): per step its wall and
    CPU seconds, the three parts' wall seconds, and per loadable request (steps asked, seconds)."""
    from ectier_vllm.metadata import ECTierWorkerMetadata

    n = len(groups[0])
    out: dict[str, list] = {"wall": [], "cpu": [], "parts": [], "latency": []}
    req, step, t_req, turn, asked = None, 0, 0.0, -1, 0
    while len(out["wall"]) < args.steps:
        step += 1
        if req is None:
            turn += 1
            hashes = groups[turn % len(groups)]
            req = _request(step, hashes, rows)
            t_req, asked = time.perf_counter(), 0
        t0, c0 = time.perf_counter(), time.thread_time()
        ready = sched.ensure_cache_available(req, 0)  # False: answered in a later step
        asked += 1
        ta = time.perf_counter()
        if ready:
            for i, h in enumerate(hashes):
                if not sched.has_cache_item(h):
                    raise RuntimeError(f"{h} not pinned")
                sched.update_state_after_alloc(req, i)
        meta = sched.build_connector_meta(v.SchedulerOutput.make_empty())
        t1, c1 = time.perf_counter(), time.thread_time()
        if asked > 1000:
            raise RuntimeError("items never ready")
        assert len(meta.loads) == (n if ready else 0)
        t2, c2 = time.perf_counter(), time.thread_time()
        if ready:  # the model step ran the loads: its output reports them
            sched.update_connector_output(v.ECConnectorOutput(
                ec_connector_worker_meta=ECTierWorkerMetadata(loaded=list(hashes))))
            sched.request_finished(req)
        t3, c3 = time.perf_counter(), time.thread_time()
        if step > args.warmup:
            out["wall"].append((t1 - t0) + (t3 - t2))
            out["cpu"].append((c1 - c0) + (c3 - c2))
            out["parts"].append((ta - t0, t1 - ta, t3 - t2))
            if ready:
                out["latency"].append((asked, t1 - t_req))
        if ready:
            req = None
        time.sleep(0.002)  # a model step runs between scheduler steps
    return out


def _report(run: dict[str, list], n: int, socket_path: str) -> None:
    import statistics

    from ectier.daemon.client import DaemonClient

    latency = run["latency"]
    print("p50 ms of ensure_cache_available / the other calls of the step / update_connector_output + "
          "request_finished: " + " / ".join(f"{statistics.median(x) * 1e3:.3f}" for x in zip(*run["parts"])))
    print(f"requests: {len(latency)}, scheduler steps until loadable p50 "
          f"{statistics.median(a for a, _ in latency):.0f} (max {max(a for a, _ in latency)}), "
          f"ms from the first ask p50 {statistics.median(t for _, t in latency) * 1e3:.3f}")
    with DaemonClient(socket_path) as c:
        tiers = c.stats().get("tiers", {})
    print("daemon hits by tier: " + ", ".join(f"{name} {t.get('hits', 0)}" for name, t in tiers.items()))
    samples, cpu = sorted(run["wall"]), sorted(run["cpu"])
    q = lambda p, xs=samples: xs[min(len(xs) - 1, int(p * len(xs)))] * 1e3  # noqa: E731
    print(f"scheduler-side cost per step, {n} items, {len(samples)} steps: p50 {q(0.5):.3f} ms, "
          f"p90 {q(0.9):.3f} ms, p99 {q(0.99):.3f} ms, max {samples[-1] * 1e3:.3f} ms")
    # the same steps in CPU time of this thread: wall >> CPU is waiting or being descheduled
    print(f"  in CPU time of the scheduler's thread: p50 {q(0.5, cpu):.3f} ms, "
          f"p99 {q(0.99, cpu):.3f} ms, max {cpu[-1] * 1e3:.3f} ms")


def main() -> None:
    args = _args()
    from ectier.bench import connector_driver as cd

    v = cd._v()
    rows, n = 64 * args.mib, args.items
    groups_n = 4 if args.nvme else 1
    directory = tempfile.mkdtemp(prefix="ectier-step-", dir="/var/tmp" if args.nvme else "/tmp")
    # twice the items: every pin within daemon.view_pin_bytes (half the arena by default)
    daemon = cd._Daemon(directory, (2 * n + 4) * rows * 8192 * 2, nvme=args.nvme).start()
    sched = None
    try:
        groups = [[f"step-item-{g}-{i}" for i in range(n)] for g in range(groups_n)]
        _store_groups(daemon.socket_path, groups, rows)
        model = cd.write_model(os.path.join(directory, "model"), rows * n)
        cfg = cd._vllm_config(model, rows * n, "ECTierConnector", "ec_consumer",
                              {"mode": "daemon", "socket_path": daemon.socket_path, "namespace": "bench",
                               **({} if args.wait_s is None else {"daemon_answer_wait_s": args.wait_s})},
                              "ectier_vllm.connector")
        sched = v.Factory.create_connector(cfg, v.Role.SCHEDULER)
        from vllm.utils.gc_utils import freeze_gc_heap

        freeze_gc_heap()  # as vLLM's engine core does once started: its steps run over a frozen heap
        _report(_run_steps(v, sched, groups, rows, args), n, daemon.socket_path)
    finally:
        gc.unfreeze()  # (frozen objects are never freed at exit: nanobind reports them as leaks)
        if sched is not None:
            sched.shutdown()
        daemon.stop()
        daemon.remove()
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
