"""Builds vLLM 0.33's real Scheduler and the real model-runner EC mixin around ECTierConnector, on CPU.

Nothing is downloaded: the model is a tiny Qwen2-Audio ``config.json`` written to a temporary
directory (its vLLM registration needs no torchvision, unlike the image models). vLLM's
``MultiModalBudget`` would build the HF processor (which needs tokenizer files), so
:func:`make_scheduler` replaces it, inside the scheduler module only, by :class:`FixedBudget`: the
numbers it would compute (encoder compute budget, encoder cache size). Everything else is vLLM's
own code: ``Scheduler`` (with its ``EncoderCacheManager`` and ``KVCacheManager``),
``ECConnectorFactory`` loading the connector through ``ec_connector_module_path``, ``Request``,
``ECConnectorModelRunnerMixin`` and ``ensure_ec_transfer_initialized`` for the worker side.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass

import torch

MODULE = "ectier_vllm.connector"
# the stand-in encoder's output width: what the tiny model's encoder puts in encoder_cache, i.e. its
# text hidden size (ModelConfig.get_inputs_embeds_size(); Qwen3-VL-30B-A3B would be 2048 * 4 = 8192)
WIDTH = 64
DTYPE = torch.bfloat16


def write_tiny_model(directory: str) -> str:
    cfg = {
        "architectures": ["Qwen2AudioForConditionalGeneration"],
        "model_type": "qwen2_audio",
        "audio_config": {"model_type": "qwen2_audio_encoder", "d_model": 32, "encoder_attention_heads": 2,
                         "encoder_ffn_dim": 64, "encoder_layers": 1, "num_mel_bins": 128,
                         "max_source_positions": 1500},
        "text_config": {"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                        "vocab_size": 1000, "max_position_embeddings": 4096},
        "audio_token_index": 999,
        "torch_dtype": "bfloat16",
    }
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return directory


def make_vllm_config(model_dir: str, role: str, extra: dict, *, connector: str = "ECTierConnector",
                     max_num_batched_tokens: int = 2048, module_path: str | None = MODULE,
                     gpu_memory_utilization: float = 0.9, **scheduler):
    from vllm.config import CacheConfig, ECTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                               max_model_len=2048, seed=0)
    scheduler_config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens, max_model_len=2048,
                                       is_encoder_decoder=False, enable_chunked_prefill=True,
                                       **scheduler)  # more SchedulerConfig fields
    cache_config = CacheConfig(block_size=16, gpu_memory_utilization=gpu_memory_utilization, cache_dtype="auto",
                               enable_prefix_caching=False)
    cache_config.num_gpu_blocks = 1000
    ec = ECTransferConfig(ec_connector=connector, ec_role=role, ec_connector_module_path=module_path,
                          ec_connector_extra_config=extra)
    return VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                      cache_config=cache_config, ec_transfer_config=ec)


class FixedBudget:
    """Stands in for vllm.multimodal.encoder_budget.MultiModalBudget (see module docstring)."""

    compute_budget = 2048
    cache_size = 4096  # embeddings the scheduler's EncoderCacheManager may hold

    def __init__(self, vllm_config, mm_registry, *args, **kwargs):
        self.encoder_compute_budget = self.compute_budget
        self.encoder_cache_size = self.cache_size
        self.mm_max_toks_per_item = {"audio": 512}
        self.mm_limits = {"audio": 4}


def make_scheduler(vllm_config, monkeypatch):
    import vllm.v1.core.sched.scheduler as sched_mod
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    monkeypatch.setattr(sched_mod, "MultiModalBudget", FixedBudget)
    kv_cache_config = KVCacheConfig(
        num_blocks=1000, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=16, num_kv_heads=1,
                                                                        head_size=1, dtype=torch.float32))],
    )
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=16, log_stats=True)


@dataclass
class Item:
    mm_hash: str
    offset: int
    length: int


def make_request(req_id: str, items: list[Item], prompt_len: int = 600, max_tokens: int = 4):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    feats = [MultiModalFeatureSpec(data=None, modality="audio", identifier=it.mm_hash,
                                   mm_position=PlaceholderRange(offset=it.offset, length=it.length))
             for it in items]
    return Request(request_id=req_id, prompt_token_ids=[1] * prompt_len,
                   sampling_params=SamplingParams(max_tokens=max_tokens), pooling_params=None,
                   mm_features=feats)


def encoder_output(mm_hash: str, n: int) -> torch.Tensor:
    """A deterministic stand-in encoder output for ``mm_hash``: (n, WIDTH) bfloat16."""
    g = torch.Generator().manual_seed(abs(hash(mm_hash)) % (2**31))
    return torch.randn(n, WIDTH, generator=g).to(DTYPE)


@contextlib.contextmanager
def as_agent(connector):
    """Make ``connector`` vLLM's process-global worker connector (``get_ec_transfer()``) for a while."""
    from vllm.distributed.ec_transfer import ec_transfer_state

    before = ec_transfer_state._EC_CONNECTOR_AGENT
    ec_transfer_state._EC_CONNECTOR_AGENT = connector
    try:
        yield connector
    finally:
        ec_transfer_state._EC_CONNECTOR_AGENT = before


class Worker:
    """The worker side as vLLM 0.33's model runners drive it, on CPU.

    ``runner="v1"``: the real ``ECConnectorModelRunnerMixin`` (GPU model runner V1): the context
    manager around the encoder run and the embedding gather, and ``maybe_save_ec_to_connector``
    right after each item is encoded (as ``_cache_encoder_output`` does). For a pure producer it
    does what ``GPUModelRunner.execute_model`` does: it returns
    ``make_empty_encoder_model_runner_output`` from inside the context manager, so the
    ``ECConnectorOutput`` it filled never reaches the scheduler.
    ``runner="v2"``: the real ``ActiveECConnector`` of the V2 model runner
    (``vllm.v1.worker.gpu.ec_connector``): ``start_save_caches``, ``start_load_caches``, then
    ``save_caches`` for every item new in the encoder cache after the step's encoder run.
    Both use the process-global connector made by ``ensure_ec_transfer_initialized``, or
    ``connector`` (one worker of several, e.g. a tensor-parallel rank: it is made the process-global
    connector while this worker runs). Like the runners it keeps each request's items from its
    first scheduling on, so a later chunk's or a resumed request's encoder inputs are encoded too;
    ``gather`` does what ``_gather_mm_embeddings`` does with a missing entry of an item the step's
    tokens reach: it raises. It does not drop what vLLM frees (``free_encoder_mm_hashes``): tests
    that need that pop them themselves.
    """

    def __init__(self, vllm_config, runner: str = "v1", connector=None):
        from vllm.distributed.ec_transfer import ec_transfer_state

        if connector is None:
            ec_transfer_state.ensure_ec_transfer_shutdown()
            ec_transfer_state.ensure_ec_transfer_initialized(vllm_config)
            connector = ec_transfer_state.get_ec_transfer()
        self.connector = connector
        self.runner = runner
        self.encoder_cache: dict[str, torch.Tensor] = {}
        if runner == "v2":
            from vllm.v1.worker.gpu.ec_connector import ActiveECConnector

            with as_agent(connector):
                self.v2 = ActiveECConnector(vllm_config, self.encoder_cache)
        self.encoded: list[str] = []
        self.gathered: dict[str, torch.Tensor] = {}
        self.features: dict[str, list] = {}  # req_id -> mm_features, as the runner keeps them

    def _encode_and_gather(self, scheduler_output, save_each: bool):
        from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin as M

        for req in scheduler_output.scheduled_new_reqs:  # the runner's persistent request state
            self.features[req.req_id] = req.mm_features
        for req_id, inputs in scheduler_output.scheduled_encoder_inputs.items():
            for i in inputs:  # new requests' items, and later chunks' or resumed requests' ones
                f = self.features[req_id][i]
                self.encoder_cache[f.identifier] = encoder_output(f.identifier, f.mm_position.get_num_embeds())
                self.encoded.append(f.identifier)
                if save_each:
                    M.maybe_save_ec_to_connector(self.encoder_cache, f.identifier)
        for req in scheduler_output.scheduled_new_reqs:
            lo = req.num_computed_tokens
            hi = lo + scheduler_output.num_scheduled_tokens.get(req.req_id, 0)
            for f in req.mm_features:
                if not (f.mm_position.offset < hi and f.mm_position.offset + f.mm_position.length > lo):
                    continue  # not reached by this step's chunk (_gather_mm_embeddings skips it)
                t = self.encoder_cache.get(f.identifier)
                if t is None:
                    raise RuntimeError(f"Encoder cache miss for {f.identifier}.")
                self.gathered[f.identifier] = t.clone()

    #: after each step, wait for the saves it started (the connector puts in a background
    #: thread): the next step then finds them stored, as it would after a real model step's time.
    #: Tests that hold copies in flight (a deferred copy engine) set this False.
    settle_saves = True

    def execute(self, scheduler_output):
        """One execute_model: encode what was scheduled, gather, and return a ModelRunnerOutput."""
        with as_agent(self.connector):
            out = self._execute(scheduler_output)
        if self.settle_saves and hasattr(self.connector, "saves"):
            assert self.connector.saves.wait(30), "the connector's saves did not finish"
        return out

    def _execute(self, scheduler_output):
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.ec_connector_model_runner_mixin import ECConnectorModelRunnerMixin as M

        if self.runner == "v2":
            with self.v2.maybe_get_output(scheduler_output) as ec_out:
                self._encode_and_gather(scheduler_output, save_each=False)
        elif not self.connector.is_consumer:  # GPUModelRunner.execute_model, encoder-only instance
            from vllm.v1.outputs import make_empty_encoder_model_runner_output

            with M.maybe_get_ec_connector_output(scheduler_output, encoder_cache=self.encoder_cache):
                self._encode_and_gather(scheduler_output, save_each=True)
                return make_empty_encoder_model_runner_output(scheduler_output)
        else:
            with M.maybe_get_ec_connector_output(scheduler_output, encoder_cache=self.encoder_cache) as ec_out:
                self._encode_and_gather(scheduler_output, save_each=True)
        req_ids = [r.req_id for r in scheduler_output.scheduled_new_reqs] + list(
            scheduler_output.scheduled_cached_reqs.req_ids)
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[[5] for _ in req_ids], logprobs=None, prompt_logprobs_dict={},
            pooler_output=[], ec_connector_output=ec_out,
        )
