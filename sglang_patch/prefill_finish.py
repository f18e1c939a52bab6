"""Requests that finish in their prefill free their graft state too.

SGLang tells a speculative worker a request finished (``note_request_finished``) only from the
decode path (``batch_result_processor.py:1442``); a request that finishes in its prefill
(``max_new_tokens`` 1, a stop token first, an abort in flight: ``process_batch_result_prefill``,
``batch_result_processor.py:258``) releases its KV cache and is gone without it, while the planner
holds the state its prefill gave it (isolation group, host sources, token history). An ``AFTER``
hook on ``process_batch_result_prefill`` reports every finished request of the batch to the graft
worker, which frees what it holds (freeing an unknown or already freed request does nothing).
"""

from __future__ import annotations

import logging

from sglang_patch.hooks import register_hook

logger = logging.getLogger(__name__)

TARGET_MODULE = "sglang.srt.managers.scheduler_components.batch_result_processor"
TARGET = f"{TARGET_MODULE}.SchedulerBatchResultProcessor.process_batch_result_prefill"


def free_finished_in_prefill(result, processor, batch, *args, **kwargs):
    """``AFTER`` hook: ``note_request_finished`` for every finished request of the prefill batch
    ``batch`` on a graft worker. Returns ``result`` unchanged; never raises (a failure is logged)."""
    worker = getattr(processor, "draft_worker", None)
    note = getattr(worker, "note_prefill_finished", None)
    if note is None:
        return result
    try:
        for req in getattr(batch, "reqs", None) or ():
            if req.finished():
                note(req.rid)
    except Exception:  # noqa: BLE001 - bookkeeping must never break result processing
        logger.exception("graft: freeing requests finished in prefill failed")
    return result


def register_prefill_finish() -> bool:
    """Register the hook (scheduler processes only). Returns True when newly registered."""
    return register_hook(TARGET, free_finished_in_prefill, "AFTER", only_if_imported="sglang.srt.managers.scheduler")
