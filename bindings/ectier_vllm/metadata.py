"""What the scheduler-side connector tells the workers each step, and what they answer.

Both travel through vLLM (``SchedulerOutput.ec_connector_metadata`` and
``ECConnectorOutput.ec_connector_worker_meta``): plain dataclasses of strings and ints, so they
pickle/msgspec-serialise cheaply between the scheduler and worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorMetadata,
    ECConnectorWorkerMetadata,
)


@dataclass
class LoadItem:
    """One encoder output the worker must place in ``encoder_cache`` this step.

    ``shape``/``dtype`` are those of the stored entry, already checked by the scheduler against
    what the request expects (``num_embeds`` rows, the model dtype); the worker checks what it
    reads against them again. ``req_ids``: requests that need it (failed together if the load fails).
    """

    mm_hash: str
    shape: tuple[int, ...]
    dtype: str
    req_ids: list[str] = field(default_factory=list)


@dataclass
class ECTierConnectorMetadata(ECConnectorMetadata):
    """Scheduler → worker: the items to load this step."""

    loads: list[LoadItem] = field(default_factory=list)


@dataclass
class ECTierWorkerMetadata(ECConnectorWorkerMetadata):
    """Worker → scheduler, once per step (aggregated over workers by vLLM).

    Fields:
        loaded: mm_hashes placed in ``encoder_cache`` this step (the scheduler drops their pins).
        failed: mm_hash → request ids whose item could not be loaded (vanished, wrong shape/dtype,
            store error): those requests are reported by ``take_unavailable_requests``.
        saved: mm_hashes whose save completed (visible to consumers).
        save_failed: mm_hashes whose save failed (logged; the item is simply not shared).
        stats: counters and load times of this step (see ``ectier_vllm.metrics``).
    """

    loaded: list[str] = field(default_factory=list)
    failed: dict[str, list[str]] = field(default_factory=dict)
    saved: list[str] = field(default_factory=list)
    save_failed: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)

    def aggregate(self, other: "ECConnectorWorkerMetadata") -> "ECTierWorkerMetadata":
        from .metrics import merge_stats_data

        assert isinstance(other, ECTierWorkerMetadata)
        failed = {k: list(v) for k, v in self.failed.items()}
        for k, v in other.failed.items():
            failed.setdefault(k, [])
            failed[k].extend(r for r in v if r not in failed[k])
        return ECTierWorkerMetadata(
            loaded=sorted(set(self.loaded) | set(other.loaded)),
            failed=failed,
            saved=sorted(set(self.saved) | set(other.saved)),
            save_failed=sorted(set(self.save_failed) | set(other.save_failed)),
            stats=merge_stats_data(self.stats, other.stats),
        )
