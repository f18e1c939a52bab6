"""The batch budget's verify widths and graft's retrieval state reserved before SGLang sizes the KV cache.

SGLang sizes the KV pool from the device memory left after the weights
(``KVCacheConfigurator._profile_available_bytes``, ``mem_cache/kv_cache_configurator.py:2990``);
graft's extra verify-width states (`sglang_patch.verify_widths.WidthStates`) are built later, after
the CUDA-graph capture, and would otherwise come out of the headroom SGLang keeps for activations.
An ``AFTER`` hook on that method, in the target's scheduler process of a graft server whose batch
budget has more than one width, takes the widths' reserve off the profiled bytes before the pool is
sized, so the pool is smaller by exactly the reserve.

The planner's device state comes off first (`GraftPlanner.state_bytes`: one successor table per
isolation group, ``retrieval.max_tenants`` of them by default, the output index, the token history);
when it would take more than half of the profiled bytes the server does not start (a message names
the fields that size it). The reserve per extra width is ``batch_budget.width_reserve_mib`` when set, else an estimate
(`estimate_width_bytes`: the formulas of `sglang_patch.memory`, for the server's attention backend,
graph batch size and context). When the extra widths would take more than half of the profiled
bytes, the budget narrows itself: the widest extra widths are dropped until the rest fits, with a
warning at startup; `kept_widths` gives the worker the widths it builds. The worker compares what
its states took with the reserve (`check_built`) and ``/server_info`` reports both
(``worker.memory_beyond_eagle3.kv_reserve``).

With tensor parallelism every rank profiles the minimum free memory over the ranks
(``distributed=True`` in SGLang's profile) and computes the same reserve, so every rank keeps the
same widths.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Optional, Sequence

from graft_spec.pipeline import GraftPlanner
from sglang_patch.args import GraftSettingsError, effective_graft_config
from sglang_patch.hooks import register_hook
from sglang_patch.memory import FLASHINFER_WORKSPACE_BYTES, Serving, width_state_bytes

logger = logging.getLogger(__name__)

__all__ = ["TARGET", "estimate_width_bytes", "plan_reserve", "reserve_after_profile", "kept_widths",
           "check_built", "summary", "register_kv_reserve"]

#: SGLang 0.5.23's KV budget (``kv_cache_configurator.py:2990``), in bytes.
TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes"
#: Processes that size a KV pool import this module first (the scheduler's entry point).
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
MIB = 1024 ** 2
#: The extra widths may take at most this share of the profiled KV bytes; beyond it the budget narrows.
MAX_SHARE = 0.5

#: What the hook decided in this process (the scheduler's; empty until the KV pool is sized).
_plan: Dict[str, Any] = {}


def estimate_width_bytes(width: int, *, backend: str, graphs: bool, graph_max_bs: int, context: int) -> int:
    """Bytes one extra verify-width state is expected to hold, per rank (`sglang_patch.memory`'s
    `width_state_bytes`): the target attention backend's own workspace (FlashInfer:
    ``SGLANG_FLASHINFER_WORKSPACE_SIZE``, default 384 MiB; 0 for other backends) and, with CUDA graphs,
    the target verify and draft extend backends' KV-index and tree-mask buffers sized for
    ``graph_max_bs`` requests of ``width`` tokens over ``context`` positions (the draft decode backend
    is the full width's, shared).

    Args:
        width: verify tokens per request of the state.
        backend: the decode attention backend's name.
        graphs: whether CUDA graphs are captured.
        graph_max_bs: the largest captured decode batch.
        context: the model's context length (tokens).
    """
    workspace = 0
    if backend == "flashinfer":
        workspace = int(os.environ.get("SGLANG_FLASHINFER_WORKSPACE_SIZE", FLASHINFER_WORKSPACE_BYTES))
    serving = Serving(max_running_requests=graph_max_bs if graphs else 0, context=context, attn_workspace=workspace)
    return width_state_bytes(serving, width)


def plan_reserve(available: int, widths: Sequence[int], full_width: int, per_width: Dict[int, int],
                 max_share: float = MAX_SHARE) -> Dict[str, Any]:
    """Which extra widths fit and what they reserve.

    Args:
        available: the profiled KV bytes (SGLang's figure before the reserve).
        widths: the batch budget's verify widths (the full width N among them).
        full_width: N (its state is SGLang's own, not an extra one).
        per_width: bytes reserved for each extra width.
        max_share: the share of ``available`` the extra widths may take.
    Returns:
        ``{"widths": kept widths (sorted), "dropped": dropped widths, "reserve_bytes": int,
        "by_width": {width: bytes}}``: the widest extra widths are dropped first until the rest
        fits; width 1 (a plain decode step, the cheapest) is dropped last.
    """
    extra = sorted((w for w in widths if w != full_width), key=lambda w: (w != 1, w))
    kept = list(extra)
    while kept and sum(per_width[w] for w in kept) > max_share * max(available, 0):
        kept.pop()
    by_width = {w: int(per_width[w]) for w in kept}
    return {"widths": sorted([full_width, *kept]), "dropped": sorted(set(extra) - set(kept)),
            "reserve_bytes": int(sum(by_width.values())), "by_width": by_width}


def reserve_after_profile(result: int, configurator, *args, **kwargs) -> int:
    """``AFTER`` hook of `TARGET`: ``result`` (bytes) minus the reserve of graft's extra widths, on
    the target of a graft server with the batch budget on; ``result`` unchanged elsewhere and on
    any error (logged: the reserve must never stop a server that would otherwise start)."""
    try:
        if configurator.is_draft_worker or _algorithm(configurator) != "GRAFT":
            return result
        return _reserve(int(result), configurator)
    except GraftSettingsError:
        raise   # graft's own state does not fit: the server must not start
    except Exception as exc:  # noqa: BLE001
        logger.warning("graft: no KV reserve for the batch budget's widths (%r)", exc)
        return result


def _algorithm(configurator) -> str:
    algo = configurator.spec_algorithm
    return str(getattr(algo, "name", algo)).upper()


def _reserve(available: int, configurator) -> int:
    """Plan the reserve for this configurator's server (`plan_reserve`), log it, record it in `_plan`
    and return the KV bytes left."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.speculative.eagle_worker_v2 import check_cuda_graph_backend


    sa = resolving_view(configurator.server_args)
    cfg = effective_graft_config(sa)
    state = _planner_state(cfg, configurator, sa, available)
    available -= sum(state.values())
    widths = cfg.verify_widths
    n = cfg.num_draft_tokens
    if cfg.batch_budget.width_reserve_mib is not None:
        per_width = {w: cfg.batch_budget.width_reserve_mib * MIB for w in widths}
        source = "batch_budget.width_reserve_mib"
    else:
        graphs = not check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED)
        max_bs = get_exec().graph.cuda_graph_config.decode.max_bs or getattr(sa, "max_running_requests", None) or 1
        backend = str(getattr(sa, "decode_attention_backend", None) or getattr(sa, "attention_backend", None) or "")
        per_width = {w: estimate_width_bytes(w, backend=backend, graphs=graphs, graph_max_bs=int(max_bs),
                                             context=int(configurator.model_config.context_len)) for w in widths}
        source = "estimate"
    plan = plan_reserve(available, widths, n, per_width)
    profiled = available + sum(state.values())
    plan.update(profiled_bytes=profiled, kv_bytes=available - plan["reserve_bytes"], source=source,
                planner_state_bytes=state)
    plan["reserve_bytes"] += sum(state.values())   # the planner's state came off the KV bytes too
    try:  # accounting only: the KV tokens SGLang's configurator gives with and without the reserve
        from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

        pool, page = create_memory_pool_configurator(configurator), configurator.page_size
        plan["kv_tokens_without_reserve"] = int(pool.calculate_pool_sizes(profiled, page).max_total_num_tokens)
        plan["kv_tokens"] = int(pool.calculate_pool_sizes(plan["kv_bytes"], page).max_total_num_tokens)
    except Exception as exc:  # noqa: BLE001
        logger.debug("graft: KV tokens of the reserve not computed (%r)", exc)
    _plan.clear()
    _plan.update(plan)
    if plan["dropped"]:
        logger.warning("graft: the batch budget's verify widths %s would take more than %d%% of the %d MiB left "
                       "for the KV cache; building widths %s only (dropped %s). Set batch_budget.widths, or "
                       "raise --mem-fraction-static", list(widths), int(MAX_SHARE * 100), available // MIB,
                       plan["widths"], plan["dropped"])
    logger.info("graft: %d MiB of the %d MiB profiled for the KV cache reserved for verify widths %s (%s: %s) "
                "and graft's retrieval state (%s)", plan["reserve_bytes"] // MIB, profiled // MIB,
                [w for w in plan["widths"] if w != n], source, {w: b // MIB for w, b in plan["by_width"].items()},
                {k: f"{v / MIB:.1f} MiB" for k, v in state.items()})
    return plan["kv_bytes"]


def _planner_state(cfg, configurator, sa, available: int) -> Dict[str, int]:
    """The planner's device state (`GraftPlanner.state_bytes`: the successor table of every isolation
    group, the output index, the token history) for this server.

    Raises:
        GraftSettingsError: it would take more than `MAX_SHARE` of the profiled KV bytes (names the
            fields that size it).
    """

    max_bs = int(getattr(sa, "max_running_requests", None) or 1)
    state = GraftPlanner.state_bytes(cfg, int(configurator.model_config.vocab_size), max_bs, max_bs + 1)
    if sum(state.values()) > MAX_SHARE * max(available, 0):
        r = cfg.retrieval
        raise GraftSettingsError(
            f"graft's retrieval state needs {sum(state.values()) // MIB} MiB ({ {k: v // MIB for k, v in state.items()} } "
            f"MiB), more than {int(MAX_SHARE * 100)}% of the {available // MIB} MiB left for the KV cache: lower "
            f"retrieval.max_tenants ({r.max_tenants}, one successor table each) or retrieval.outputs_max_tokens "
            f"({r.outputs_max_tokens}), or raise --mem-fraction-static")
    return state


def kept_widths(widths: Sequence[int]) -> tuple[int, ...]:
    """``widths`` narrowed to what the KV reserve kept (unchanged when no reserve was planned in this
    process)."""
    if not _plan:
        return tuple(widths)
    keep = set(_plan["widths"])
    return tuple(w for w in widths if w in keep)


def check_built(bytes_by_width: Dict[int, int]) -> None:
    """Compare what the width states took (`WidthStates.bytes_by_width`) with the reserve; a warning
    when they took more than 10% (and 16 MiB) over it."""
    if not _plan:
        return
    built = int(sum(bytes_by_width.values()))
    _plan["built_bytes"] = built
    over = built - _plan["reserve_bytes"]
    if over > max(16 * MIB, 0.1 * _plan["reserve_bytes"]):
        logger.warning("graft: the verify-width states took %d MiB, %d MiB over the %d MiB reserved before the "
                       "KV cache was sized; set batch_budget.width_reserve_mib (per extra width) to at least %d",
                       built // MIB, over // MIB, _plan["reserve_bytes"] // MIB,
                       -(-built // max(1, len(bytes_by_width)) // MIB))


def summary() -> Optional[Dict[str, Any]]:
    """The plan as plain data for ``/server_info`` (None when no reserve was planned)."""
    if not _plan:
        return None
    return {k: ({str(w): b for w, b in v.items()} if isinstance(v, dict) else v) for k, v in _plan.items()}


def register_kv_reserve() -> bool:
    """Register `reserve_after_profile` with SGLang's HookRegistry (once, in scheduler processes only:
    elsewhere resolving `TARGET` would import the model stack for nothing). True when newly registered."""
    return register_hook(TARGET, reserve_after_profile, "AFTER", only_if_imported=SCHEDULER_MODULE)
