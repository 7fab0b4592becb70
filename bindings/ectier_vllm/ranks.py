"""Which worker of an engine saves encoder outputs and reports the worker counters.

With tensor parallelism every rank of a TP group runs the same vision encoder on the same items
and ends the step with the same encoder output in its ``encoder_cache`` (a TP-sharded encoder
all-gathers its result; vLLM's ``mm_encoder_tp_mode="data"`` splits the items over the ranks and
all-gathers them too). Saving from every rank would copy, send and write the same bytes N times.
So exactly one worker of each engine (each data-parallel replica: a replica schedules its own
requests) saves, the *lead worker*, decided from vLLM 0.33's parallel state
(``vllm.distributed.parallel_state``):

- TP rank 0 (``get_tensor_model_parallel_rank() == 0``; decode context parallelism splits the TP
  ranks, so it needs no rule of its own),
- of the first pipeline stage (``get_pipeline_model_parallel_rank() == 0``): vLLM runs the
  encoder for the model on the first stage (the V1 runner's ``_preprocess`` and the V2 runner
  gate it on ``get_pp_group().is_first_rank``; an encoder-only producer may run it on every
  stage), so the first stage always holds every output; the other stages' copies are duplicates,
- of prefill context parallel rank 0 (``get_pcp_group().rank_in_group == 0``): every PCP rank
  encodes the same items.

Every worker still loads (each needs the tensor in its own ``encoder_cache``), but only the lead
worker counts loads and saves in the stats it reports, so the counters vLLM sums over the workers
(``ECOutputAggregator``) are not multiplied by the number of ranks.

Before vLLM has set up model parallelism (a connector built outside a worker, tests) there is
one worker, which is the lead.
"""

from __future__ import annotations


def is_lead_worker() -> bool:
    """True iff this process is its engine's lead worker (see the module docstring).

    Reads vLLM's parallel state once per call (cheap attribute reads); raises nothing: groups
    vLLM has not created count as rank 0.
    """
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return True
    if ps.get_tensor_model_parallel_rank() != 0 or ps.get_pipeline_model_parallel_rank() != 0:
        return False
    try:
        pcp_rank = ps.get_pcp_group().rank_in_group
    except AssertionError:  # no prefill context parallel group: rank 0
        pcp_rank = 0
    return pcp_rank == 0
