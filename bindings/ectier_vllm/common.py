"""What every part of the connector shares: its logger, the errors that become misses, and the model's
encoder output widths."""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.logger import init_logger

from ectier.errors import EctierError

#: one logger for the connector's modules, a child of vLLM's (``vllm.ectier``): vLLM's handler,
#: format and ``VLLM_LOGGING_LEVEL`` apply to it (a logger outside ``vllm`` was never shown: vLLM
#: configures only its own)
logger = init_logger("vllm.ectier")


def route_core_logs() -> None:
    """Let ectier's core loggers (``ectier.*``: the tiers, the daemon client) write through vLLM's
    handler when nothing else would: the process configured no logging of its own (no handler on
    the root logger or on ``ectier``) and vLLM configured its ``vllm`` logger
    (``VLLM_CONFIGURE_LOGGING``). Without it their INFO lines were dropped and their warnings
    printed bare, without time or process."""
    core, vllm_logger = logging.getLogger("ectier"), logging.getLogger("vllm")
    if core.handlers or logging.getLogger().handlers or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        core.addHandler(handler)
    if core.level == logging.NOTSET:
        core.setLevel(vllm_logger.level or logging.INFO)


def ectier_variables_ignored() -> list[str]:
    """The ``ECTIER_*`` environment variables set in this process: the connector does not read them
    (its settings come from ``ec_connector_extra_config``, or the file its ``config_path`` names)."""
    return sorted(name for name in os.environ if name.startswith("ECTIER_"))

#: errors that become misses: ectier's own, OS-level trouble talking to the daemon, and torch's
#: device errors while copying an entry (RuntimeError: torch.OutOfMemoryError, CUDA errors)
STORE_ERRORS = (EctierError, OSError, RuntimeError)
#: per-item warnings (misses, failed saves and loads) of one kind are written at most once per
#: this many seconds, with a count of the ones left out (a daemon that is down fails every item)
WARN_INTERVAL_S = 10.0


def encoder_output_widths(model_config: Any) -> frozenset[int] | None:
    """Widths of the tensors vLLM puts in ``encoder_cache`` for this model (``None``: unknown).

    Usually one: the language model's input-embedding size (``ModelConfig.get_inputs_embeds_size()``:
    the text hidden size, or a projection size), which is what vLLM itself assumes for ``mm_embeds``
    inputs and its CPU EC connector. Exception: "deepstack" vision encoders (Qwen3-VL, Qwen3-VL-MoE,
    Qwen3.5, ...: ``vision_config.deepstack_visual_indexes``) return the main embedding and one
    extra embedding per deepstack level concatenated, ``(N, vision_config.out_hidden_size * (1 +
    len(deepstack_visual_indexes)))``, which ``embed_input_ids`` splits again (2048 * 4 = 8192 for
    Qwen3-VL-30B-A3B); every visual item of such a model has that width. Qwen3-Omni keeps its
    vision config in ``thinker_config``: its images/videos have the deepstack width, its audio the
    input-embedding size, so both are accepted.
    """
    try:
        hf = model_config.hf_config
        base = int(model_config.get_inputs_embeds_size())
        vision = getattr(hf, "vision_config", None)
        if vision is not None and getattr(vision, "deepstack_visual_indexes", None) is not None:
            deep = int(vision.out_hidden_size) * (1 + len(vision.deepstack_visual_indexes))
            others = any(getattr(hf, k, None) is not None for k in ("audio_config", "thinker_config"))
            widths = {deep, base} if others else {deep}
        else:
            widths = {base}
            thinker = getattr(hf, "thinker_config", None)
            vision = getattr(thinker, "vision_config", None) if thinker is not None else None
            if vision is not None and getattr(vision, "deepstack_visual_indexes", None) is not None:
                widths.add(int(vision.out_hidden_size) * (1 + len(vision.deepstack_visual_indexes)))
    except Exception:  # noqa: BLE001 - an unusual config: fall back to the rows+dtype check
        return None
    return frozenset(widths) if all(w > 0 for w in widths) else None

