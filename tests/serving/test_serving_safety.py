"""A graft server that is safe for many users: private by default, contained failures, checked
inputs, bounded state, and every request feature exact or refused (docs/serving.md, "Many users").

What must hold (the package's quick graft server unless said otherwise; greedy outputs are compared
with the no-speculation server's token for token):

* isolation: what one isolation key's answers taught graft (the output index) serves requests of
  the same key only, for ``extra_key`` and for ``cache_salt``; requests with neither share one group;
* no ``meta_info.graft_src`` unless ``return_sources`` is on;
* with one group (``retrieval.max_tenants: 1``) a second key's requests get private state while the
  first key's request runs, and the first key's group is not handed over meanwhile;
* an injected failing graft step (three rounds) leaves the server up, outputs equal to no-spec, the
  failures counted on ``/server_info`` and speculation turned off;
* a non-boolean ``graft_speculate`` and ``return_hidden_states`` get a 400 naming the field;
* short, aborted and stop-at-first-token requests leave no per-request state;
* a prompt far longer than the suffix index's window costs one window's insertion;
* structured output, logprobs, ``n > 1``, penalties, ``min_new_tokens`` and ``min_p`` equal the
  no-speculation server's outputs (logprobs within float tolerance).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List

import httpx
import pytest

from sglang_patch.launcher import SGLangServer, start_all

from .client import generate, healthy, new_client, payload, server_stats, stream_and_disconnect, wait_idle
from .conftest import COMMON, graft_args, load_prompts

pytestmark = [pytest.mark.server, pytest.mark.models]

VOCAB = 2048
GREEDY = {"max_new_tokens": 32, "temperature": 0.0}


def _post(url: str, body: Dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=300)


def _ok(url: str, body: Dict[str, Any]) -> Dict[str, Any]:
    r = _post(url, body)
    assert r.status_code == 200, r.text
    return r.json()


def _from_outputs(reply: Dict[str, Any]) -> int:
    """Output tokens of ``reply`` that came from the output index (``graft_src`` letter ``o``)."""
    return reply["meta_info"]["graft_src"].count("o")


def _unique_prompt(seed: int) -> List[int]:
    """A prompt no other test sends: random tokens, then the start of a code prompt."""
    rng = random.Random(seed)
    return [rng.randrange(300, VOCAB) for _ in range(24)] + list(range(265, 300))


# ---------------------------------------------------------------------------------- isolation
#: N verified every round: the isolation checks need speculative rounds (the batch budget runs
#: plain rounds wherever they are faster, on these CPUs most of the time)
FIXED_N = {"GRAFTCFG_BATCH_BUDGET__ENABLED": "false", "GRAFTCFG_RETURN_SOURCES": "true"}


@pytest.fixture(scope="module")
def special(quick_models, servers):
    """Three more graft servers with N every round, started in parallel: the default isolation, one
    isolation group (``retrieval.max_tenants: 1``), and one whose graft step fails in decode rounds
    3, 6 and 9."""
    stamp = int(time.time())
    envs = {"isolation": FIXED_N, "tenants1": {**FIXED_N, "GRAFTCFG_RETRIEVAL__MAX_TENANTS": "1"},
            "faulty": {**FIXED_N, "GRAFT_FAULT_FAILING_ROUNDS": "3,6,9"}}
    out = {name: SGLangServer(model_path=str(quick_models.target), args=[*COMMON, *graft_args(quick_models.draft)],
                              env=env, log_path=f"/tmp/serving_{name}_{stamp}.log") for name, env in envs.items()}
    start_all(list(out.values()))
    try:
        yield out
    finally:
        for srv in out.values():
            srv.stop()


@pytest.mark.parametrize("field", ["extra_key", "cache_salt"])
def test_one_keys_answers_serve_only_that_key(servers, special, field):
    """Key A's answer enters the output index when A's request stops; the same prompt under key B
    accepts nothing from the index, under key A again it accepts the answer (tau rises)."""
    url, ref = special["isolation"].url, servers.nospec.url
    prompt = _unique_prompt({"extra_key": 1, "cache_salt": 2}[field])
    sampling = {"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True}
    want = _ok(ref, payload(prompt, sampling))["output_ids"]
    first = _ok(url, payload(prompt, sampling, **{field: "tenant-a"}))
    other = _ok(url, payload(prompt, sampling, **{field: "tenant-b"}))
    same = _ok(url, payload(prompt, sampling, **{field: "tenant-a"}))
    assert first["output_ids"] == other["output_ids"] == same["output_ids"] == want
    assert _from_outputs(other) == 0, "key B accepted key A's answer from the output index"
    assert _from_outputs(same) > 0, "key A's own answer was not served back to key A"
    assert same["meta_info"]["spec_accept_length"] > other["meta_info"]["spec_accept_length"]


def test_requests_without_a_key_share_one_group(special):
    url = special["isolation"].url
    prompt = _unique_prompt(4242)
    sampling = {"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True}
    _ok(url, payload(prompt, sampling))
    assert _from_outputs(_ok(url, payload(prompt, sampling))) > 0


def test_no_sources_in_responses_unless_enabled(servers):
    out = _ok(servers.graft.url, payload(load_prompts()[0], GREEDY))
    assert "graft_src" not in out["meta_info"]


# ---------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("value", ["false", 0, None, "no"])
def test_non_boolean_opt_out_is_refused(servers, value):
    body = payload("def f(x):", {**GREEDY, "custom_params": {"graft_speculate": value}})
    r = _post(servers.graft.url, body)
    assert r.status_code == 400 and "graft_speculate" in r.text, r.text
    assert _post(servers.graft.url, payload("def f(x):", {**GREEDY, "custom_params": {"graft_speculate": False}})
                 ).status_code == 200


def test_return_hidden_states_is_refused(servers):
    r = _post(servers.graft.url, {**payload("def f(x):", GREEDY), "return_hidden_states": True})
    assert r.status_code in (400, 422) and "return_hidden_states" in r.text, r.text
    assert healthy(servers.graft.url)


# ---------------------------------------------------------------------------------- request features
FEATURES: Dict[str, Dict[str, Any]] = {
    "json_schema": {"sampling": {"max_new_tokens": 48, "temperature": 0.0, "json_schema":
                                 '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'}},
    "regex": {"sampling": {"max_new_tokens": 24, "temperature": 0.0, "regex": "(def|class) [a-z_]{1,12}\\("}},
    "ebnf": {"sampling": {"max_new_tokens": 24, "temperature": 0.0,
                          "ebnf": 'root ::= "x = " [0-9]+ "\\n"'}},
    "frequency_penalty": {"sampling": {**GREEDY, "frequency_penalty": 0.6}},
    "presence_penalty": {"sampling": {**GREEDY, "presence_penalty": 0.6}},
    "repetition_penalty": {"sampling": {**GREEDY, "repetition_penalty": 1.3}},
    "min_new_tokens": {"sampling": {**GREEDY, "min_new_tokens": 20}},
    # min_p runs plain rounds; greedy, because SGLang honours sampling_seed only with
    # --enable-deterministic-inference (sampling_batch_info.py:157), so sampled outputs never repeat
    "min_p": {"sampling": {**GREEDY, "min_p": 0.1}},
    "n_2": {"sampling": {**GREEDY, "n": 2}},
}


#: features SGLang applies through its penalizer (``sampling/penaltylib``): their outputs depend on
#: how the overlap scheduler batches requests, in a server without speculation too (the per-round
#: accumulation, ``ScheduleBatch.cumulate_penalty_output_tokens``, reads each request's last output
#: token, which at times lags a round), so they are sent one at a time
PENALIZED = ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens")
#: the features whose batch graft runs plain besides those (SGLang's decode step:
#: sglang_patch/request_features.py); the rest it speculates through
PLAIN_ONLY = ("min_p",)


def _wave(url: str, names, prompts) -> Dict[tuple, Any]:
    """Every feature of ``names`` on every prompt, all requests at once: ``{(name, prompt index): reply}``."""
    bodies = [((name, i), payload(p, FEATURES[name]["sampling"])) for name in names for i, p in enumerate(prompts)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        return dict(zip((key for key, _ in bodies), pool.map(lambda kb: _ok(url, kb[1]), bodies)))


def _feature_replies(url: str, prompts) -> Dict[tuple, Any]:
    """The penalized features one request at a time, then the other plain-round features at once,
    then the speculated ones at once (one plain request turns its whole batch's round plain, so the
    structured and ``n > 1`` requests share no batch with them)."""
    out = {(name, i): _ok(url, payload(p, FEATURES[name]["sampling"])) for name in PENALIZED
           for i, p in enumerate(prompts)}
    speculated = [n for n in FEATURES if n not in PENALIZED + PLAIN_ONLY]
    return {**out, **_wave(url, PLAIN_ONLY, prompts), **_wave(url, speculated, prompts)}


@pytest.fixture(scope="module")
def feature_replies(servers) -> Dict[str, Dict[tuple, Any]]:
    """Two prompts per feature (`_feature_replies`), on graft and on no-spec."""
    prompts = load_prompts()
    prompts = [prompts[3], prompts[90]]
    return {"graft": _feature_replies(servers.graft.url, prompts),
            "nospec": _feature_replies(servers.nospec.url, prompts)}


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_request_feature_equals_no_spec(feature_replies, name):
    for i in range(2):
        a, b = feature_replies["graft"][(name, i)], feature_replies["nospec"][(name, i)]
        if isinstance(a, list) or isinstance(b, list):     # n > 1 answers a list
            assert [x["output_ids"] for x in a] == [x["output_ids"] for x in b], (name, i)
        else:
            assert a["output_ids"] == b["output_ids"], (name, i, a["output_ids"], b["output_ids"])


def test_logprobs_equal_no_spec_within_tolerance(servers):
    body = {**payload(load_prompts()[5], GREEDY), "return_logprob": True, "top_logprobs_num": 3}
    a, b = _ok(servers.graft.url, body), _ok(servers.nospec.url, body)
    assert a["output_ids"] == b["output_ids"]
    la, lb = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
    assert len(la) == len(lb) == len(a["output_ids"])
    for (va, ia, _), (vb, ib, _) in zip(la, lb):
        assert ia == ib and abs(va - vb) <= 1e-4, (va, vb)
    ta, tb = a["meta_info"]["output_top_logprobs"], b["meta_info"]["output_top_logprobs"]
    for ra, rb in zip(ta, tb):
        assert [x[1] for x in ra] == [x[1] for x in rb]
        assert all(abs(x[0] - y[0]) <= 1e-4 for x, y in zip(ra, rb))


# ---------------------------------------------------------------------------------- bounded state
def test_short_aborted_and_first_token_requests_leave_no_state(servers):
    """Many requests that end before or right after their first decode round, and streams that
    disconnect: the planner's per-request state is back at zero (``/server_info`` ``planner_state``)."""
    url = servers.graft.url
    prompts = load_prompts()

    async def go():
        async with new_client(24) as client:
            firsts = [(await generate(client, url, payload(prompts[10 + i], {"max_new_tokens": 1,
                                                                             "temperature": 0.0}))).output_ids[0]
                      for i in range(4)]
            tasks = [generate(client, url, payload(prompts[20 + i], {"max_new_tokens": 1, "temperature": 0.0}))
                     for i in range(8)]
            tasks += [generate(client, url, payload(prompts[10 + i], {"max_new_tokens": 16, "temperature": 0.0,
                                                                       "stop_token_ids": [tok]}))
                      for i, tok in enumerate(firsts)]
            tasks += [stream_and_disconnect(client, url, payload(prompts[30 + i], {
                "max_new_tokens": 128, "temperature": 0.0, "ignore_eos": True}, extra_key=f"k{i}"), after_chunks=1)
                for i in range(6)]
            return await asyncio.gather(*tasks)

    asyncio.run(go())
    stats = wait_idle(url, servers.baseline, timeout_s=60)
    assert stats["worker"]["planner_state"] == {"grouped": 0, "host_sources": 0, "output_index": 0, "keys_held": 0}
    assert stats["worker"]["step_path"] == "torch reference, eager (CPU)"   # which graft step runs, on CPU


def test_a_long_prompt_inserts_one_window(servers, special):
    """A prompt 40 times the suffix index's window (512 nodes at depth 12: 21 tokens) is indexed by
    its tail, capped while it inserts (the cap's rebuild counter moves), and the output equals
    no-spec, as does a short request decoding beside it. N every round: the suffix index is built
    in speculative rounds only."""
    url, ref = special["isolation"].url, servers.nospec.url
    prompt = ([280, 78, 340, 281, 79] * 180)[:880]
    body = payload(prompt, {"max_new_tokens": 24, "temperature": 0.0})
    beside = payload(load_prompts()[7], {"max_new_tokens": 24, "temperature": 0.0})
    before = server_stats(url)["worker"]["suffix_rebuilds"]

    async def go():
        async with new_client(2) as client:
            return await asyncio.gather(generate(client, url, body), generate(client, url, beside))

    long_reply, beside_reply = asyncio.run(go())
    assert long_reply.output_ids == _ok(ref, body)["output_ids"]
    assert beside_reply.output_ids == _ok(ref, beside)["output_ids"]
    assert server_stats(url)["worker"]["suffix_rebuilds"] > before


def test_a_held_group_is_never_handed_over(servers, special):
    """One group: while key A's long request runs, key B's requests get private state (B's second
    identical request accepts nothing from the output index), and A's group is not reset (A's answer
    still serves A afterwards). A's long request samples (few tokens per round, so it is still
    running when B's two requests end) and is dropped by its client after them."""
    url, ref = special["tenants1"].url, servers.nospec.url
    pa, pb = _unique_prompt(11), _unique_prompt(12)
    long = {"max_new_tokens": 900, "temperature": 1.0, "ignore_eos": True}
    short = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    want_a, want_b = _ok(ref, payload(pa, short))["output_ids"], _ok(ref, payload(pb, short))["output_ids"]
    assert _ok(url, payload(pa, short, extra_key="A"))["output_ids"] == want_a   # A's answer in group 0

    async def go():
        async with new_client(4) as client:
            running = asyncio.create_task(generate(client, url, payload(_unique_prompt(13), long, extra_key="A")))
            await asyncio.sleep(1.0)
            b1 = await generate(client, url, payload(pb, short, extra_key="B"))
            b2 = await generate(client, url, payload(pb, short, extra_key="B"))
            still_running = not running.done()
            running.cancel()                                  # the client drops A: SGLang aborts it
            with contextlib.suppress(asyncio.CancelledError):
                await running
            return still_running, b1, b2

    a_ran, b1, b2 = asyncio.run(go())
    assert a_ran, "key A's long request ended before key B's requests: nothing was checked"
    assert b1.output_ids == b2.output_ids == want_b
    assert _from_outputs(b2.body) == 0, "a key without a group accepted text from the output index"
    again = _ok(url, payload(pa, short, extra_key="A"))
    assert again["output_ids"] == want_a
    assert _from_outputs(again) > 0, "key A's group was reset while A was running"


def test_failing_rounds_are_contained(servers, special):
    url, ref = special["faulty"].url, servers.nospec.url
    prompts = load_prompts()[:6]
    for p in prompts:
        body = payload(p, {"max_new_tokens": 24, "temperature": 0.0})
        assert _ok(url, body)["output_ids"] == _ok(ref, body)["output_ids"]
    assert healthy(url)
    failures = server_stats(url)["worker"]["round_failures"]
    assert failures["total"] == 3 and failures["speculation_off"], failures
    assert failures["by_stage"] == {"the graft step": 3}
    log = special["faulty"].log_tail(2_000_000)
    assert "InjectedFault" in log and log.count("speculation is off for this server") == 1
    assert "Scheduler hit an exception" not in log
