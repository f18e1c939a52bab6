"""No server: the ``/server_info`` stats hook (``sglang_patch.server_stats``) and the memory bound of
the retrieval structures (``GraftPlanner`` driven directly with long sequences).

The memory bound stated in docs/serving.md is measured here: with ``retrieval.suffix_max_nodes = M``
every live request holds at most ``M`` suffix-trie nodes and at most
``BYTES_PER_SUFFIX_NODE * M + PER_REQUEST_OVERHEAD`` bytes (both as ``memory_bytes()`` accounts
them and as tracemalloc measures real allocations), and ``stop_request`` frees all of it.
"""

from __future__ import annotations

import random
import tracemalloc
from types import SimpleNamespace

import pytest

from graft_spec.config import GraftConfig
from graft_spec.pipeline import GraftPlanner
from graft_spec.sources import SOURCE_DRAFT, SOURCE_PADDING, SOURCE_SUCCESSOR
from sglang_patch import server_stats
from sglang_patch.graft_requests import GraftRequestTracker
from graft_spec.stats import GraftStats

from .conftest import BYTES_PER_SUFFIX_NODE, PER_REQUEST_OVERHEAD, outputs_index_bound, retrieval_bound

VOCAB = 2048


def _planner(max_nodes: int = 512) -> GraftPlanner:
    cfg = GraftConfig.model_validate({
        "num_draft_tokens": 24, "topk": 4, "depth": 4,
        "retrieval": {"suffix_max_nodes": max_nodes, "suffix_max_depth": 12, "suffix_max_match": 6,
                      "outputs": True}})
    return GraftPlanner(cfg, vocab_size=VOCAB)


class _Allocator:
    def __init__(self, free):
        self.free = free

    def available_size(self):
        return self.free


class _Cache:
    def evictable_size(self):
        return 30

    def protected_size(self):
        return 5


def _scheduler(worker=None, free=900):
    return SimpleNamespace(
        max_total_num_tokens=1000, token_to_kv_pool_allocator=_Allocator(free), tree_cache=_Cache(),
        req_to_token_pool=SimpleNamespace(size=8, available_size=lambda: 6),
        running_batch=SimpleNamespace(reqs=[1, 2]), waiting_queue=[3],
        invariant_checker=SimpleNamespace(count_memory_leak_warnings=1), draft_worker=worker)


class _GraftWorkerLike:
    """The attributes `server_stats` reads from ``sglang_patch.graft_worker.GraftWorker``."""

    def __init__(self, planner):
        self.planner = planner
        self.requests = GraftRequestTracker(planner)
        self.stats = GraftStats()

    def live_graft_requests(self):
        return self.requests.live()


def _req(rid, prompt, outputs=()):
    return SimpleNamespace(rid=rid, origin_input_ids=list(prompt), output_ids=list(outputs),
                           customized_info=None)


# ------------------------------------------------------------------------------------------- hook
def test_pool_stats_of_a_non_graft_scheduler():
    out = server_stats.collect(_scheduler(worker=None))
    assert out["kv"] == {"capacity": 1000, "available": 900, "evictable": 30, "protected": 5, "used": 70}
    assert out["req_slots"] == {"size": 8, "available": 6}
    assert out["queues"] == {"running": 2, "waiting": 1}
    assert out["leak_warnings"] == {"kv_pool": 1, "req_pool": 0}
    assert "worker" not in out
    # an EAGLE / other worker (no live_graft_requests) adds nothing either
    assert "worker" not in server_stats.collect(_scheduler(worker=SimpleNamespace(planner=None)))


def test_graft_worker_state_appears_and_is_freed():
    planner = _planner()
    worker = _GraftWorkerLike(planner)
    succ = planner.successor.memory_bytes()
    fixed = succ + planner.outputs.index_bytes()       # the device tables: successor, output index
    empty = server_stats.collect(_scheduler(worker))["worker"]
    assert empty["live_requests"] == 0 and empty["planner_memory_bytes"] == fixed
    assert empty["outputs_index_bytes"] == planner.outputs.index_bytes()

    rng = random.Random(0)
    reqs = [_req(f"r{i}", [rng.randrange(VOCAB) for _ in range(100)]) for i in range(3)]
    worker.requests.prepare(reqs)
    worker.stats.record_round([[SOURCE_DRAFT, SOURCE_SUCCESSOR, -1], [-1, -1, -1], [SOURCE_PADDING, -1, -1]],
                              [[[0, 0, 0]] * 5] * 3, [[[0, 0]]] * 3)
    w = server_stats.collect(_scheduler(worker))["worker"]
    assert w["live_requests"] == w["planner_live_requests"] == 3
    assert w["planner_memory_bytes"] > fixed
    assert w["memory_bytes_by_source"]["successor"] == succ
    assert sum(w["memory_bytes_by_source"].values()) == w["planner_memory_bytes"]
    assert 40 <= w["suffix_max_nodes_per_request"] <= 512   # a 100-token prompt keeps its newest 512 // 12 = 42
    assert w["accepted_by_source"]["draft"] == 1 and w["accepted_by_source"]["successor"] == 1
    assert w["accepted_by_source"]["padding"] == 1 and w["accepted_tokens"]["bonus"] == 3
    assert w["accept_length_hist"] == {3: 1, 1: 1, 2: 1}
    assert w["config"]["suffix_max_nodes"] == 512

    for r in reqs:
        worker.requests.finish(r.rid)
    w = server_stats.collect(_scheduler(worker))["worker"]
    assert w["live_requests"] == w["planner_live_requests"] == 0
    assert w["planner_memory_bytes"] == fixed and w["finished_total"] == 3


def test_hook_adds_the_key_and_never_raises():
    result = SimpleNamespace(internal_state={"avg_spec_accept_length": 2.0})
    controller = SimpleNamespace(scheduler=_scheduler())
    assert server_stats.add_graft_stats(result, controller, object()) is result
    assert result.internal_state["graft"]["kv"]["used"] == 70
    assert result.internal_state["avg_spec_accept_length"] == 2.0

    class Broken:
        @property
        def max_total_num_tokens(self):
            raise RuntimeError("pool not ready")

    result = SimpleNamespace(internal_state={})
    server_stats.add_graft_stats(result, SimpleNamespace(scheduler=Broken()), object())
    assert result.internal_state["graft"]["kv"]["capacity"] is None  # unreadable field -> None
    result = SimpleNamespace(internal_state={})
    server_stats.add_graft_stats(result, object(), object())  # no .scheduler at all
    assert "error" in result.internal_state["graft"]
    odd = SimpleNamespace(internal_state=None)
    assert server_stats.add_graft_stats(odd, controller) is odd


def test_registration_only_where_the_scheduler_runs_and_once(check_hook_registration):
    from sglang.srt.plugins.hook_registry import HookType

    check_hook_registration(server_stats.register_server_stats, server_stats.TARGET_MODULE, server_stats.TARGET,
                            server_stats.add_graft_stats, HookType.AFTER)
    assert server_stats.TARGET.startswith(server_stats.TARGET_MODULE + ".SchedulerInternalStateController.")


# ---------------------------------------------------------------------------------- memory bound
def _stream(kind: str, rng: random.Random, n: int):
    if kind == "random":
        return [rng.randrange(VOCAB) for _ in range(n)]
    if kind == "low_vocab":  # many distinct substrings per token: the trie's worst case
        return [rng.randrange(4) for _ in range(n)]
    return [7] * n  # one repeated token


@pytest.mark.parametrize("max_nodes", [256, 1024, 4096])
@pytest.mark.parametrize("kind", ["random", "low_vocab", "repeat"])
def test_retrieval_memory_bounded_by_the_cap(max_nodes, kind, record_property):
    planner = _planner(max_nodes)
    suffix = planner.retriever.source("suffix")
    fixed = planner.successor.memory_bytes() + planner.outputs.index_bytes()   # device tables, fixed size
    bound = BYTES_PER_SUFFIX_NODE * max_nodes + PER_REQUEST_OVERHEAD
    rng = random.Random(max_nodes)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        planner.start_request("a", _stream(kind, rng, 200))
        peak_reported = peak_nodes = 0
        for _ in range(2500):  # ~11k tokens: many times the cap
            planner.extend("a", _stream(kind, rng, rng.randint(1, 8)))
            peak_reported = max(peak_reported, planner.memory_bytes() - fixed)
            peak_nodes = max(peak_nodes, suffix.num_nodes("a"))
        traced_peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    record_property("memory", f"M={max_nodes} {kind}: reported {peak_reported} B "
                              f"({peak_reported / max_nodes:.0f} B/node), traced peak {traced_peak} B")
    assert peak_nodes <= max_nodes
    assert peak_reported <= bound, (peak_reported, bound)
    assert traced_peak <= bound, (traced_peak, bound)
    if kind != "repeat":
        assert suffix.rebuilds > 0 and peak_nodes > max_nodes // 2  # the cap was really reached
    planner.stop_request("a")
    # only the fixed device tables stay (the output index holds what "a" wrote)
    assert planner.memory_bytes() == fixed and planner.live_requests() == 0
    assert planner.outputs.inserted > 0
    assert planner.outputs.index_bytes() <= outputs_index_bound(planner.config.retrieval)


def test_many_requests_and_a_prompt_far_over_the_cap():
    """32 live requests at the cap stay within ``retrieval_bound``; a 20k-token prompt (40x the
    cap) is cut to the cap when ``start_request`` returns (the transient peak during that one call
    grows with the prompt, i.e. is bounded by the context length)."""
    max_nodes = 512
    planner = _planner(max_nodes)
    succ = planner.successor.memory_bytes()
    rng = random.Random(1)
    for i in range(32):
        planner.start_request(i, _stream("low_vocab", rng, 1500))
        for _ in range(50):
            planner.extend(i, _stream("random", rng, 4))
    assert planner.live_requests() == 32
    index = planner.outputs.index_bytes()
    assert planner.memory_bytes() <= retrieval_bound(succ, 32, max_nodes, outputs_index_bytes=index)
    planner.start_request("long", _stream("random", rng, 20_000))
    assert planner.retriever.source("suffix").num_nodes("long") <= max_nodes
    assert planner.memory_bytes() <= retrieval_bound(succ, 33, max_nodes, outputs_index_bytes=index)
    for i in [*range(32), "long"]:
        planner.stop_request(i)
    outputs = planner.outputs
    assert planner.memory_bytes() == succ + outputs.index_bytes() and planner.live_requests() == 0
    assert outputs.index_bytes() <= outputs_index_bound(planner.config.retrieval)
