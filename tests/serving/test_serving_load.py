"""A graft server under load: 128 requests at concurrency 32 with 20% client disconnects, and one
mixed batch (greedy + sampled, stop strings / stop ids, 1-token prompts, prompts near the context
length, max_new_tokens from 1 to 32).

What must hold (compared with the no-speculation server of ``conftest.py``):

* every completed greedy response has exactly the no-spec output ids (and text / finish reason);
* sampled responses complete with valid output; no request fails;
* disconnected streams really were cut mid-generation, and the server aborts them;
* afterwards the server is healthy (``/health_generate``) and returns to idle: KV slots, request
  slots, radix-cache locks, graft tracker and planner states (``sglang_patch.server_stats``);
* the retrieval memory sampled during the run stays within the bound implied by the configured
  cap (``suffix_max_nodes``, see `retrieval_bound`).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List

import pytest

from .client import (Reply, aserver_stats, generate, healthy, new_client, payload, run_bounded,
                     server_stats, stream_and_disconnect, wait_idle)
from .conftest import (CONTEXT_LENGTH, MAX_RUNNING, RESERVED, SUFFIX_MAX_NODES, graft_retrieval_config,
                       load_prompts, outputs_index_bound, retrieval_bound)

pytestmark = [pytest.mark.server, pytest.mark.models]

N_REQUESTS = 128
FIRST_PASS = 96                 # requests past it send the first halves of earlier prompts
CONCURRENCY = 32
DISCONNECT_EVERY = 5            # request i disconnects when i % 5 == 4: 25 of 128 (20%)
MAX_NEW = (16, 24)

# ---------------------------------------------------------------------------------------- load run
@dataclass
class LoadRun:
    """Everything the load tests assert on."""

    plan: List[Dict[str, Any]]
    results: List[Any]
    samples: List[Dict[str, Any]] = field(default_factory=list)
    sample_errors: List[str] = field(default_factory=list)
    before: Dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0


def _load_plan() -> List[Dict[str, Any]]:
    prompts = load_prompts()
    plan = []
    for i in range(N_REQUESTS):
        text = prompts[(i % FIRST_PASS) * len(prompts) // FIRST_PASS]   # spread over both prompt sets
        if i >= FIRST_PASS:  # a second pass over the prompts: their first halves (radix-cache hits)
            text = text[: max(8, len(text) // 2)]
        if i % DISCONNECT_EVERY == DISCONNECT_EVERY - 1:
            plan.append({"kind": "disconnect", "prompt": text,
                         "sampling": {"max_new_tokens": 256, "temperature": 0.0, "ignore_eos": True}})
        else:
            plan.append({"kind": "complete", "prompt": text,
                         "sampling": {"max_new_tokens": MAX_NEW[i % 2], "temperature": 0.0}})
    return plan


async def _drive(url: str, plan: List[Dict[str, Any]], run: LoadRun) -> None:
    async with new_client(CONCURRENCY) as client:
        done = asyncio.Event()

        async def poll():
            while not done.is_set():
                try:
                    run.samples.append(await aserver_stats(client, url))
                except Exception as exc:  # noqa: BLE001 - asserted on in the tests
                    run.sample_errors.append(repr(exc))
                try:
                    await asyncio.wait_for(done.wait(), timeout=0.5)
                except asyncio.TimeoutError:
                    pass

        def factory(item):
            body = payload(item["prompt"], item["sampling"])
            if item["kind"] == "disconnect":
                return lambda: stream_and_disconnect(client, url, body, after_chunks=2)
            return lambda: generate(client, url, body)

        poller = asyncio.create_task(poll())
        try:
            run.results = await run_bounded([factory(it) for it in plan], CONCURRENCY)
        finally:
            done.set()
            await poller


@pytest.fixture(scope="module")
def load_run(servers) -> LoadRun:
    """128 requests at concurrency 32 on the graft server, /server_info sampled every 0.5 s."""
    plan = _load_plan()
    run = LoadRun(plan=plan, results=[])
    run.before = wait_idle(servers.graft.url, servers.baseline, timeout_s=120)
    t0 = time.monotonic()
    asyncio.run(_drive(servers.graft.url, plan, run))
    run.wall_s = time.monotonic() - t0
    print(f"\nSERVING-LOAD {N_REQUESTS} requests at concurrency {CONCURRENCY}: {run.wall_s:.1f} s, "
          f"{len(run.samples)} stats samples")
    return run


@pytest.fixture(scope="module")
def load_reference(servers, load_run) -> List[Reply]:
    """No-spec greedy outputs of the completed requests (same concurrency)."""
    items = [it for it in load_run.plan if it["kind"] == "complete"]

    async def go():
        async with new_client(CONCURRENCY) as client:
            return await run_bounded(
                [lambda it=it: generate(client, servers.nospec.url, payload(it["prompt"], it["sampling"]))
                 for it in items], CONCURRENCY)

    return asyncio.run(go())


def test_load_no_request_lost_and_greedy_equal_to_no_spec(load_run, load_reference):
    completed = [(it, r) for it, r in zip(load_run.plan, load_run.results) if it["kind"] == "complete"]
    errors = [(i, r) for i, (_, r) in enumerate(completed) if not isinstance(r, Reply) or not r.ok]
    assert not errors, f"{len(errors)} completed requests failed, e.g. {errors[:3]}"
    ref_errors = [r for r in load_reference if not isinstance(r, Reply) or not r.ok]
    assert not ref_errors, ref_errors[:3]
    assert len(completed) == N_REQUESTS - N_REQUESTS // DISCONNECT_EVERY == len(load_reference)
    mismatches = []
    for i, ((it, got), ref) in enumerate(zip(completed, load_reference)):
        if got.output_ids != ref.output_ids:
            mismatches.append((i, it["prompt"][:40], got.output_ids, ref.output_ids))
        assert got.body["meta_info"]["finish_reason"] == ref.body["meta_info"]["finish_reason"]
        assert got.body["meta_info"]["completion_tokens"] == len(got.output_ids) <= it["sampling"]["max_new_tokens"]
    assert not mismatches, f"{len(mismatches)} outputs differ from no-spec, first: {mismatches[0]}"
    # speculation really ran under load
    rounds = sum(r.body["meta_info"].get("spec_verify_ct", 0) for _, r in completed)
    tokens = sum(r.body["meta_info"]["completion_tokens"] for _, r in completed)
    assert rounds > 0 and tokens / rounds > 1.0, (tokens, rounds)
    print(f"\nSERVING-LOAD accept_length={tokens / rounds:.3f} over {len(completed)} completed requests")


def test_load_disconnects_were_mid_stream(load_run):
    cut = [(it, r) for it, r in zip(load_run.plan, load_run.results) if it["kind"] == "disconnect"]
    assert len(cut) == N_REQUESTS // DISCONNECT_EVERY
    bad = [r for _, r in cut if isinstance(r, BaseException)]
    assert not bad, f"disconnecting clients failed: {bad[:3]}"
    # every disconnect happened after 2 chunks of a 256-token (ignore_eos) stream, i.e. mid-decode
    assert all(r.chunks == 2 and not r.ended for _, r in cut), [(r.chunks, r.ended) for _, r in cut]


def test_load_disconnected_requests_were_aborted(servers, load_run):
    """The server stopped generating for the disconnected clients: the graft worker's per-request
    line (``graft request <rid> finished: rounds=R emitted=T ...``, docs/sglang_graft.md) shows each
    of them freed after far fewer than its 256 tokens."""
    if not servers.graft.log_path:
        pytest.skip("reused server without a log file")
    rids = [r.last["meta_info"]["id"] for it, r in zip(load_run.plan, load_run.results)
            if it["kind"] == "disconnect"]
    pattern = re.compile(r"graft request (\S+) finished: rounds=(\d+) emitted=(\d+)")
    deadline = time.monotonic() + 30
    while True:
        emitted = {m.group(1): int(m.group(3))
                   for m in pattern.finditer(Path(servers.graft.log_path).read_text(errors="replace"))}
        missing = [rid for rid in rids if rid not in emitted]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not missing, f"{len(missing)} disconnected requests never freed their graft state"
    longest = max(emitted[rid] for rid in rids)
    assert longest < 128, f"a disconnected request kept generating ({longest} tokens of 256)"
    print(f"\nSERVING-ABORT longest disconnected request emitted {longest} tokens before the abort")


def test_load_server_healthy_and_back_to_idle(servers, load_run, record_property):
    assert healthy(servers.graft.url)
    idle = wait_idle(servers.graft.url, servers.baseline, timeout_s=60)
    before, after = load_run.before, idle
    # graft state was created and freed for the requests that decoded (completed + aborted)
    freed = after["worker"]["finished_total"] - before["worker"]["finished_total"]
    decoded = sum(1 for it, r in zip(load_run.plan, load_run.results)
                  if it["kind"] == "disconnect" or r.body["meta_info"]["completion_tokens"] >= 2)
    assert freed >= decoded, (freed, decoded)
    summary = {"kv_idle_before": before["kv"], "kv_idle_after": after["kv"],
               "req_slots_after": after["req_slots"], "graft_state_freed": freed,
               "peak_kv_used": max(s["kv"]["used"] for s in load_run.samples),
               "peak_running": max(s["queues"]["running"] for s in load_run.samples),
               "peak_live_graft_requests": max(s["worker"]["live_requests"] for s in load_run.samples),
               "wall_s": round(load_run.wall_s, 1)}
    record_property("serving_load", json.dumps(summary))
    print("\nSERVING-LOAD-IDLE", json.dumps(summary))
    # the sampler saw the load (the stats are live, not a constant)
    assert summary["peak_kv_used"] > 0 and summary["peak_live_graft_requests"] > 1


def test_load_retrieval_memory_within_cap(load_run, record_property):
    assert not load_run.sample_errors, load_run.sample_errors[:3]
    assert len(load_run.samples) >= 3
    worst = None
    for s in load_run.samples:
        w = s["worker"]
        succ = w["memory_bytes_by_source"]["successor"]
        assert w["suffix_max_nodes_per_request"] <= SUFFIX_MAX_NODES, w
        assert w["live_requests"] <= MAX_RUNNING, w
        index = w.get("outputs_index_bytes", 0)   # shared output index (when on), bounded on its own
        assert index <= outputs_index_bound(graft_retrieval_config()), w
        bound = retrieval_bound(succ, w["planner_live_requests"], outputs_index_bytes=index)
        assert w["planner_memory_bytes"] <= bound, (w, bound)
        if worst is None or w["planner_memory_bytes"] > worst["planner_memory_bytes"]:
            worst = dict(w, bound=bound)
    per_req = (worst["planner_memory_bytes"] - worst["memory_bytes_by_source"]["successor"]) / max(
        worst["planner_live_requests"], 1)
    summary = {"peak_planner_memory_bytes": worst["planner_memory_bytes"],
               "bound_at_peak": worst["bound"], "live_at_peak": worst["planner_live_requests"],
               "successor_bytes": worst["memory_bytes_by_source"]["successor"],
               "suffix_bytes_per_live_request_at_peak": round(per_req),
               "max_suffix_nodes_per_request": max(s["worker"]["suffix_max_nodes_per_request"]
                                                   for s in load_run.samples),
               "suffix_max_nodes_cap": SUFFIX_MAX_NODES}
    record_property("serving_memory", json.dumps(summary))
    print("\nSERVING-MEMORY", json.dumps(summary))


# ------------------------------------------------------------------------------------ mixed batch
def _mixed_requests(tokenizer, stop_texts: Dict[int, str], stop_ids: Dict[int, int]) -> List[Dict[str, Any]]:
    """One batch of everything at once (kind: greedy -> compared with no-spec, sampled -> valid)."""
    prompts = load_prompts()
    corpus = tokenizer.encode("\n\n".join(prompts)).ids
    reqs = []

    def add(kind, prompt, **sampling):
        reqs.append({"kind": kind, "prompt": prompt, "sampling": sampling})

    for i, n in enumerate((1, 8, 32)):                       # max_new_tokens 1 .. 32
        add("greedy", prompts[i], max_new_tokens=n, temperature=0.0)
    for t in (corpus[0], corpus[5], corpus[100]):             # one-token prompts
        add("greedy", [t], max_new_tokens=16, temperature=0.0)
    for j, (i, stop) in enumerate(sorted(stop_texts.items())):  # stop strings from the reference
        add("greedy", prompts[i], max_new_tokens=32, temperature=0.0, stop=[stop])
    for i, tok in sorted(stop_ids.items()):                   # stop token ids from the reference
        add("greedy", prompts[i], max_new_tokens=32, temperature=0.0, stop_token_ids=[tok])
    # near the context length: graft (like EAGLE) reserves N = 24 slots of it for the draft tree
    # (utils.py compute_num_reserved_tokens), so prompt + 24 + max_new_tokens <= CONTEXT_LENGTH;
    # the first and last are exactly at the limit
    room = CONTEXT_LENGTH - RESERVED
    for start, (plen, n) in enumerate(((room - 24, 24), (room - 40, 32), (room - 16, 16))):
        add("greedy", corpus[start * 997: start * 997 + plen], max_new_tokens=n, temperature=0.0)
    add("sampled", corpus[3000: 3000 + room - 40], max_new_tokens=32, temperature=0.8, top_p=0.9)
    for i, sp in enumerate(({"temperature": 0.8, "top_p": 0.95}, {"temperature": 1.0, "top_k": 20},
                            {"temperature": 0.6, "min_p": 0.1}, {"temperature": 1.2, "top_p": 0.5, "top_k": 5})):
        add("sampled", prompts[20 + i], max_new_tokens=(8, 16, 24, 32)[i], **sp)
    add("sampled", [corpus[7]], max_new_tokens=16, temperature=0.9)
    add("sampled", prompts[30], max_new_tokens=1, temperature=0.7)
    return reqs


async def _send_all(url: str, reqs: List[Dict[str, Any]]) -> List[Any]:
    async with new_client(len(reqs)) as client:
        return await run_bounded([lambda r=r: generate(client, url, payload(r["prompt"], r["sampling"]))
                                  for r in reqs], len(reqs))


@pytest.fixture(scope="module")
def mixed(servers, tokenizer):
    """(requests, graft replies, no-spec replies) of one mixed batch sent all at once."""
    prompts = load_prompts()
    # stop strings / ids taken from the middle of the no-spec outputs, so the stop really triggers
    probe = asyncio.run(_send_all(servers.nospec.url, [
        {"prompt": prompts[i], "sampling": {"max_new_tokens": 32, "temperature": 0.0}} for i in (10, 11, 12)]))
    stop_texts, stop_ids = {}, {}
    for i, r in zip((10, 11), probe[:2]):
        text = r.body["text"]
        mid = len(text) // 2
        if text[mid:mid + 3].strip():
            stop_texts[i] = text[mid:mid + 3]
    r = probe[2]
    stop_ids[12] = r.output_ids[len(r.output_ids) // 2]
    reqs = _mixed_requests(tokenizer, stop_texts, stop_ids)
    got = asyncio.run(_send_all(servers.graft.url, reqs))
    ref = asyncio.run(_send_all(servers.nospec.url, reqs))
    return reqs, got, ref, stop_texts


def test_mixed_batch_none_fail_greedy_equal_sampled_valid(mixed, tokenizer):
    reqs, got, ref, stop_texts = mixed
    assert stop_texts, "no usable stop string found in the reference outputs"
    vocab = tokenizer.get_vocab_size()
    failures = [(r["sampling"], g) for r, g in zip(reqs, got) if not isinstance(g, Reply) or not g.ok]
    assert not failures, failures[:3]
    stopped = 0
    for r, g, n in zip(reqs, got, ref):
        assert isinstance(n, Reply) and n.ok, (r["sampling"], n)
        meta = g.body["meta_info"]
        assert len(g.output_ids) == meta["completion_tokens"] <= r["sampling"]["max_new_tokens"]
        assert all(0 <= t < vocab for t in g.output_ids)
        if r["kind"] == "greedy":
            assert g.output_ids == n.output_ids, (r["sampling"], len(r["prompt"]), g.output_ids, n.output_ids)
            assert g.body["text"] == n.body["text"]
            assert meta["finish_reason"] == n.body["meta_info"]["finish_reason"]
            stopped += meta["finish_reason"]["type"] == "stop" and ("stop" in r["sampling"] or
                                                                    "stop_token_ids" in r["sampling"])
        else:
            assert meta["finish_reason"]["type"] in ("length", "stop"), meta["finish_reason"]
            assert meta["completion_tokens"] >= 1
    assert stopped >= 2, "stop strings / stop ids never triggered"


def test_mixed_batch_leaves_server_idle(servers, mixed):
    assert healthy(servers.graft.url)
    wait_idle(servers.graft.url, servers.baseline, timeout_s=60)


def test_requests_stopped_by_their_first_token_leave_no_state(servers):
    """A request whose first token (sampled by its prefill) matches a stop id, sent while another
    request decodes: under the overlap scheduler it is already in the next decode round when its
    prefill's result finishes it, and SGLang sends the worker no finish notification for it
    (``batch_result_processor.py:1442`` runs for decode results only). Before the fix every such
    request left its graft state behind (12 of 12, measured)."""
    prompts = load_prompts()

    async def go():
        async with new_client(16) as client:
            firsts = [(await generate(client, servers.graft.url,
                                      payload(prompts[1 + i], {"max_new_tokens": 1, "temperature": 0.0}))).output_ids[0]
                      for i in range(6)]
            long = asyncio.create_task(generate(client, servers.graft.url, payload(
                prompts[0], {"max_new_tokens": 96, "temperature": 0.0, "ignore_eos": True})))
            await asyncio.sleep(0.5)
            shorts = []
            for i, tok in enumerate(firsts):
                shorts.append(asyncio.create_task(generate(client, servers.graft.url, payload(
                    prompts[1 + i], {"max_new_tokens": 16, "temperature": 0.0, "stop_token_ids": [tok]}))))
                await asyncio.sleep(0.15)
            return await long, await asyncio.gather(*shorts)

    long, shorts = asyncio.run(go())
    assert long.ok and len(long.output_ids) == 96
    assert all(r.ok and len(r.output_ids) == 1 for r in shorts), shorts
    assert all(r.body["meta_info"]["finish_reason"]["type"] == "stop" for r in shorts)
    wait_idle(servers.graft.url, servers.baseline, timeout_s=30)


def test_stats_on_a_server_without_speculation(servers):
    """The stats hook runs on every server with the plugin: pools and queues, no graft worker."""
    stats = server_stats(servers.nospec.url)
    assert "worker" not in stats and "error" not in stats
    assert stats["kv"]["capacity"] == 65536 and stats["kv"]["used"] == 0
    assert stats["req_slots"]["available"] == stats["req_slots"]["size"] == MAX_RUNNING
