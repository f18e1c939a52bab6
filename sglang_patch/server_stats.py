"""Serving statistics in ``GET /server_info``: KV/request pools, queues and graft's per-request state.

An ``AFTER`` hook on SGLang's internal-state readback
(``SchedulerInternalStateController.get_internal_state``,
``srt/managers/scheduler_components/internal_state.py``) adds one ``"graft"`` dict to the
scheduler's state, so it appears as ``GET /server_info`` -> ``internal_states[i]["graft"]`` (one
entry per data-parallel scheduler). The hook only reads; it works for every server (graft, other
speculative algorithms, no speculation, any device): the ``"graft"`` sub-dict ``"worker"`` is
present only when the scheduler's speculative worker is graft's.

Fields (token counts are KV slots; all ints unless said otherwise)::

    kv:            capacity (max_total_num_tokens), available (allocator free), evictable (radix
                   cache, reclaimable), protected (radix cache, locked by running requests),
                   used = capacity - available - evictable
    req_slots:     size, available (req_to_token rows)
    queues:        running, waiting
    leak_warnings: SGLang's own idle invariant check (KV pool / req pool leak warnings so far)
    worker:        (graft only) live_requests (tracker), planner_live_requests, finished_total,
                   planner_memory_bytes, memory_bytes_by_source {name: bytes} (suffix, corpus, the
                   successor table), suffix_max_nodes_per_request, suffix_rebuilds, and the host
                   statistics of ``graft_spec.stats.GraftStats.summary``: accepted_tokens {draft,
                   retrieved, padding, bonus}, accept_length_hist, calibration {member: {trials,
                   estimated, observed}} (mean estimated vs observed acceptance of the verified nodes
                   each source proposed), acceptance_by_depth, draft_forwards {run, skipped}
                   (also as draft_steps), verify_widths {width: rounds}, last_batch_verify_tokens;
                   batch_budget (``graft_spec.budget.BatchBudget.summary``: widths, rounds_by_width,
                   last choice, correction, round_ms per batch-size bucket and width,
                   deferred_draft_extend {skipped (request-rounds), catch_ups, memory_bytes}, or
                   {"enabled": false}); accepted_by_source {source name: tokens} (graft_spec/sources.py);
                   config caps (suffix_max_nodes, suffix_max_depth, successor_k);
                   memory_beyond_eagle3 {width_states, width_states_by_width, planner,
                   deferred_draft_extend, total, kv_reserve} (bytes, `memory_beyond_eagle3`)

Idle means: queues 0/0, ``kv.used == 0`` and ``kv.protected == 0``, ``req_slots.available ==
req_slots.size``, ``worker.live_requests == worker.planner_live_requests == 0``.

Registered from ``sglang_patch.plugin.register``, which SGLang runs in every process. The hook is
registered only where the target module is already imported: the scheduler processes (their entry
``run_scheduler_process`` lives in ``managers/scheduler.py``, which imports ``internal_state`` at
module level, ``scheduler.py:240``, before calling ``load_plugins``, ``:6323``) and in-process
``Engine`` users (``engine.py:110`` imports the scheduler). Elsewhere (the HTTP/tokenizer process,
the detokenizer) resolving the target would import ~900 extra modules (~4 s on 2 CPU cores) for a
hook that never runs there, so nothing is registered.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict

from sglang_patch import kv_reserve
from sglang_patch.hooks import register_hook

logger = logging.getLogger(__name__)

#: SGLang 0.5.23 readback behind ``/server_info`` (``internal_state.py``, ``get_internal_state``).
TARGET = ("sglang.srt.managers.scheduler_components.internal_state."
          "SchedulerInternalStateController.get_internal_state")
#: Module of `TARGET`; registration is skipped in processes that have not imported it.
TARGET_MODULE = TARGET.rsplit(".", 2)[0]
#: Key added to the scheduler's internal state.
KEY = "graft"


def _safe(fn: Callable[[], Any], default: Any = None) -> Any:
    """``fn()``, or ``default`` when the attribute chain does not exist in this server."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a stats read must never fail the readback
        return default


def pool_stats(scheduler) -> Dict[str, Any]:
    """KV pool, request-slot pool, queue lengths and leak-warning counters of a ``Scheduler``.

    Source: SGLang 0.5.23 ``pool_stats_observer.py:235`` (``_get_token_info``: used = capacity -
    available - evictable) and ``invariant_checker.py`` (idle leak checks, warning counters).
    """
    s = scheduler
    capacity = _safe(lambda: int(s.max_total_num_tokens))
    available = _safe(lambda: int(s.token_to_kv_pool_allocator.available_size()))
    evictable = _safe(lambda: int(s.tree_cache.evictable_size()), 0)
    protected = _safe(lambda: int(s.tree_cache.protected_size()), 0)
    used = None if capacity is None or available is None else capacity - available - evictable
    checker = _safe(lambda: s.invariant_checker)
    return {
        "kv": {"capacity": capacity, "available": available, "evictable": evictable,
               "protected": protected, "used": used},
        "req_slots": {"size": _safe(lambda: int(s.req_to_token_pool.size)),
                      "available": _safe(lambda: int(s.req_to_token_pool.available_size()))},
        "queues": {"running": _safe(lambda: len(s.running_batch.reqs), 0),
                   "waiting": _safe(lambda: len(s.waiting_queue), 0)},
        "leak_warnings": {
            "kv_pool": int(getattr(checker, "count_memory_leak_warnings", 0) or 0),
            "req_pool": int(getattr(checker, "count_req_pool_leak_warnings", 0) or 0),
        },
    }


def graft_worker_stats(worker) -> Dict[str, Any]:
    """Per-request state of a graft worker (``sglang_patch.graft_worker.GraftWorker``).

    Returns an empty dict for any other worker (it has no ``live_graft_requests``).
    """
    if worker is None or not hasattr(worker, "live_graft_requests"):
        return {}
    planner = getattr(worker, "planner", None)
    tracker = getattr(worker, "requests", None)
    sources = list(_safe(lambda: planner.retrieval_sources(), []) or [])
    out: Dict[str, Any] = {
        "live_requests": int(worker.live_graft_requests()),
        "planner_live_requests": _safe(lambda: int(planner.live_requests())),
        "finished_total": _safe(lambda: int(tracker.finished_total)),
        "planner_memory_bytes": _safe(lambda: int(planner.memory_bytes())),
        "memory_bytes_by_source": {getattr(src, "name", type(src).__name__):
                                   _safe(lambda src=src: int(src.memory_bytes())) for src in sources},
    }
    rids = list(_safe(lambda: tracker.states.keys(), []) or [])
    for src in sources:
        if hasattr(src, "index_bytes"):  # the output index: shared ring + tables, fixed size
            out["outputs_index_bytes"] = _safe(lambda src=src: int(src.index_bytes()))
        if hasattr(src, "num_nodes"):  # the suffix index: per-request trie sizes
            out["suffix_max_nodes_per_request"] = max((src.num_nodes(r) for r in rids), default=0)
            out["suffix_rebuilds"] = int(getattr(src, "rebuilds", 0))
    stats = _safe(lambda: worker.stats.summary())
    if stats is not None:  # host accumulators: no device read here
        out.update(stats)
        out["draft_steps"] = stats["draft_forwards"]
        out["accepted_by_source"] = {k: v for k, v in stats["accepted_tokens"].items() if k != "bonus"}
    budget = _safe(lambda: worker.budget)
    out["batch_budget"] = _safe(lambda: budget.summary()) if budget is not None else {"enabled": False}
    deferred = _safe(lambda: worker.deferred)
    if deferred is not None and isinstance(out["batch_budget"], dict):
        out["batch_budget"]["deferred_draft_extend"] = {
            "skipped": deferred.deferred, "catch_ups": deferred.catch_ups, "memory_bytes": deferred.memory_bytes()}
    out["memory_beyond_eagle3"] = _safe(lambda: memory_beyond_eagle3(worker))
    out["round_failures"] = _safe(lambda: worker.guard.summary())
    out["planner_state"] = _safe(lambda: planner.state_counts())
    out["plain_round"] = "decode"   # a width-1 round runs SGLang's decode step (sglang_patch/plain_round.py)
    out["step_path"] = _safe(lambda: worker.step_path)   # fused / reference kernels, graphs / eager
    cfg = _safe(lambda: planner.config.retrieval)
    if cfg is not None:
        out["config"] = {"suffix": cfg.suffix, "suffix_max_nodes": cfg.suffix_max_nodes,
                         "suffix_max_depth": cfg.suffix_max_depth, "successor": cfg.successor,
                         "successor_k": cfg.successor_k}
    return out


def memory_beyond_eagle3(worker) -> Dict[str, int]:
    """Bytes a graft worker holds that an EAGLE-3 worker of the same tree shape does not: the extra
    verify-width runtime states (``WidthStates.bytes_by_width``, tensors not shared with the full-width
    state; ``widths_sharing_draft_decode``: the widths whose state holds the full width's draft decode
    backend and graphs), the planner's state (successor table, token history, output index, suffix / corpus
    indexes: ``GraftPlanner.memory_bytes``) and the deferred draft extend's buffers; ``total`` sums them.
    ``kv_reserve``: what was taken off the KV cache for the widths before it was sized
    (`sglang_patch.kv_reserve.summary`: profiled_bytes, reserve_bytes, by_width, kv_bytes, widths,
    dropped, source, built_bytes), None when nothing was reserved."""
    states = getattr(worker, "width_states", None)
    ws = getattr(states, "bytes_by_width", {}) or {}
    deferred = getattr(worker, "deferred", None)
    out = {"width_states": int(sum(ws.values())),
           "width_states_by_width": {int(k): int(v) for k, v in ws.items()},
           "widths_sharing_draft_decode": sorted(getattr(states, "shared_draft_decode", []) or []),
           "planner": int(worker.planner.memory_bytes()),
           "deferred_draft_extend": int(deferred.memory_bytes()) if deferred is not None else 0}
    out["total"] = out["width_states"] + out["planner"] + out["deferred_draft_extend"]
    out["kv_reserve"] = kv_reserve.summary()
    return out


def collect(scheduler) -> Dict[str, Any]:
    """The ``"graft"`` dict for one scheduler (pool stats, plus ``worker`` on graft servers)."""
    out = pool_stats(scheduler)
    worker = _safe(lambda: scheduler.draft_worker)
    wstats = graft_worker_stats(worker)
    if wstats:
        out["worker"] = wstats
    return out


def add_graft_stats(result, controller, *args, **kwargs):
    """``AFTER`` hook: ``result.internal_state[KEY] = collect(controller.scheduler)``.

    Args:
        result: ``GetInternalStateReqOutput`` (``internal_state``: plain dict).
        controller: the ``SchedulerInternalStateController`` (``.scheduler``).
    Returns:
        ``result`` (the same object, one key added). Never raises: a failure is reported as
        ``{"error": "..."}`` under the key.
    """
    state = getattr(result, "internal_state", None)
    if not isinstance(state, dict):
        return result
    try:
        state[KEY] = collect(controller.scheduler)
    except Exception as exc:  # noqa: BLE001 - stats must never break /server_info
        logger.warning("graft server stats failed: %r", exc)
        state[KEY] = {"error": repr(exc)}
    return result


def register_server_stats() -> bool:
    """Register `add_graft_stats` with SGLang's HookRegistry (once per process).

    Must run before ``HookRegistry.apply_hooks()`` (the plugin entry point). Does nothing in a
    process that has not imported `TARGET_MODULE` (see the module docstring). Returns True when
    newly registered.
    """
    return register_hook(TARGET, add_graft_stats, "AFTER", only_if_imported=TARGET_MODULE)
