"""Faults and bad input on a graft server: adversarial prompts, invalid requests, invalid plugin
configuration.

What must hold:

* prompts that stress retrieval (one repeated token, a short repeated pattern, random tokens and a
  4-token alphabet far over the retrieval cap) give exactly the no-spec greedy output, and the cap
  is enforced (suffix-trie rebuilds happen, no trie exceeds it);
* bad requests (empty prompts, out-of-vocabulary / negative token ids, negative temperature,
  top_p > 1, max_new_tokens < 0, unknown or mistyped fields, prompts over the context budget) get a
  4xx with a message naming the problem, or a correct output; never a 5xx, never a crash;
* requests running at the same time are unaffected (equal to no-spec), and the server is healthy
  and back to idle afterwards;
* an invalid graft configuration makes ``python -m sglang.launch_server`` exit non-zero, before
  loading any model, with one message naming the field.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List

import pytest

from .client import Reply, generate, healthy, new_client, payload, post, run_bounded, server_stats, wait_idle
from .conftest import CONTEXT_LENGTH, RESERVED, ROOT, SUFFIX_MAX_NODES, load_prompts

pytestmark = [pytest.mark.server, pytest.mark.models]

VOCAB = 2048
GREEDY = {"max_new_tokens": 32, "temperature": 0.0}


def _adversarial_prompts() -> Dict[str, List[int]]:
    rng = random.Random(7)
    room = CONTEXT_LENGTH - RESERVED - GREEDY["max_new_tokens"]  # longest prompt graft accepts
    return {
        "one_repeated_token": [266] * 600,
        "repeated_pattern": [280, 78, 340] * 300,
        "random_over_cap": [rng.randrange(VOCAB) for _ in range(room)],  # > SUFFIX_MAX_NODES tokens
        "four_token_alphabet": [rng.choice((265, 266, 267, 268)) for _ in range(900)],
        "single_token": [266],
    }


#: name -> (path, body, words the error message must contain). Expected: 4xx on both servers.
BAD_REQUESTS: Dict[str, Any] = {
    "empty_text": ("/generate", {"text": "", "sampling_params": GREEDY}, ["empty"]),
    "empty_input_ids": ("/generate", {"input_ids": [], "sampling_params": GREEDY}, ["empty"]),
    "negative_token_id": ("/generate", {"input_ids": [5, -3, 7], "sampling_params": GREEDY}, ["token id"]),
    "token_id_out_of_vocab": ("/generate", {"input_ids": [5, VOCAB + 100], "sampling_params": GREEDY},
                              ["token id", str(VOCAB)]),
    "negative_temperature": ("/generate", {"text": "def f(x):", "sampling_params": {"temperature": -1}},
                             ["temperature"]),
    "top_p_above_1": ("/generate", {"text": "def f(x):", "sampling_params": {"top_p": 1.5}}, ["top_p"]),
    "negative_max_new_tokens": ("/generate", {"text": "def f(x):", "sampling_params": {"max_new_tokens": -1}},
                                ["max_new_tokens"]),
    "top_k_zero": ("/generate", {"text": "def f(x):", "sampling_params": {"top_k": 0}}, ["top_k"]),
    "unknown_sampling_field": ("/generate", {"text": "def f(x):", "sampling_params": {"max_new_tokens": 4,
                                                                                      "bogus_knob": 1}},
                               ["bogus_knob"]),
    "mistyped_field": ("/generate", {"text": "def f(x):", "sampling_params": {"max_new_tokens": "many"}},
                       ["invalid type"]),
    "max_new_tokens_beyond_context": ("/generate", {"text": "def f(x):",
                                                    "sampling_params": {"max_new_tokens": 100_000}},
                                      ["context length"]),
    "oai_negative_temperature": ("/v1/completions", {"model": "default", "prompt": "def f(x):",
                                                     "max_tokens": 8, "temperature": -1}, ["temperature"]),
    "oai_top_p_above_1": ("/v1/completions", {"model": "default", "prompt": "def f(x):", "max_tokens": 8,
                                              "top_p": 2}, ["top_p"]),
    "oai_negative_max_tokens": ("/v1/completions", {"model": "default", "prompt": "def f(x):",
                                                    "max_tokens": -1}, ["max_tokens"]),
    "oai_empty_prompt": ("/v1/completions", {"model": "default", "prompt": "", "max_tokens": 8}, ["empty"]),
    "oai_out_of_vocab_ids": ("/v1/completions", {"model": "default", "prompt": [VOCAB + 5], "max_tokens": 8},
                             ["token id"]),
}

#: Accepted and answered correctly: ignored unknown top-level / OpenAI fields, max_new_tokens 0.
ODD_BUT_VALID: Dict[str, Any] = {
    "unknown_top_level_field": ("/generate", {"text": "def f(x):", "bogus": 1, "sampling_params": GREEDY}),
    "oai_unknown_field": ("/v1/completions", {"model": "default", "prompt": "def f(x):", "max_tokens": 8,
                                              "temperature": 0, "bogus_knob": 1}),
    "zero_max_new_tokens": ("/generate", {"text": "def f(x):", "sampling_params": {"max_new_tokens": 0}}),
}


async def _fire(url: str) -> Dict[str, Any]:
    """Background traffic, adversarial prompts, bad and odd requests, all at the same time."""
    prompts = load_prompts()
    background = [payload(p, {"max_new_tokens": 24, "temperature": 0.0}) for p in prompts[40:56]]
    adversarial = {k: payload(v, GREEDY) for k, v in _adversarial_prompts().items()}
    async with new_client(64) as client:
        jobs = ([lambda b=b: generate(client, url, b) for b in background]
                + [lambda b=b: generate(client, url, b) for b in adversarial.values()]
                + [lambda p=p, b=b: post(client, url, p, b) for p, b, _ in BAD_REQUESTS.values()]
                + [lambda p=p, b=b: post(client, url, p, b) for p, b in ODD_BUT_VALID.values()])
        out = await run_bounded(jobs, 64)
    nb, na, nbad = len(background), len(adversarial), len(BAD_REQUESTS)
    return {"background": out[:nb],
            "adversarial": dict(zip(adversarial, out[nb:nb + na])),
            "bad": dict(zip(BAD_REQUESTS, out[nb + na:nb + na + nbad])),
            "odd": dict(zip(ODD_BUT_VALID, out[nb + na + nbad:]))}


@pytest.fixture(scope="module")
def fault_run(servers):
    before = wait_idle(servers.graft.url, servers.baseline, timeout_s=120)
    graft = asyncio.run(_fire(servers.graft.url))
    nospec = asyncio.run(_fire(servers.nospec.url))
    return before, graft, nospec


def test_adversarial_prompts_equal_no_spec_and_cap_enforced(servers, fault_run):
    before, graft, nospec = fault_run
    for name, got in graft["adversarial"].items():
        ref = nospec["adversarial"][name]
        assert isinstance(got, Reply) and got.ok, (name, got)
        assert isinstance(ref, Reply) and ref.ok, (name, ref)
        assert got.output_ids == ref.output_ids, (name, got.output_ids, ref.output_ids)
    after = wait_idle(servers.graft.url, servers.baseline, timeout_s=60)
    assert len(_adversarial_prompts()["random_over_cap"]) > SUFFIX_MAX_NODES
    # prompts over the cap forced suffix-trie rebuilds (and none held more than the cap: the
    # planner checks it after every extend; test_serving_load samples it under load)
    assert after["worker"]["suffix_rebuilds"] > before["worker"]["suffix_rebuilds"]


def test_bad_requests_get_clear_4xx(fault_run):
    _, graft, nospec = fault_run
    problems = []
    for name, (path, body, words) in BAD_REQUESTS.items():
        got = graft["bad"][name]
        if not isinstance(got, Reply) or not 400 <= got.status < 500:
            problems.append((name, got))
            continue
        text = str(got.body).lower()
        missing = [w for w in words if w.lower() not in text]
        if missing:
            problems.append((name, f"message lacks {missing}: {got.body}"))
        ref = nospec["bad"][name]  # same verdict without speculation (the guard is plugin-wide)
        if not isinstance(ref, Reply) or ref.status != got.status:
            problems.append((name, f"no-spec answered {ref}"))
    assert not problems, problems


def test_odd_but_valid_requests_answer_correctly(fault_run):
    _, graft, nospec = fault_run
    for name, got in graft["odd"].items():
        ref = nospec["odd"][name]
        assert isinstance(got, Reply) and got.ok, (name, got)
        if "output_ids" in got.body:
            if ODD_BUT_VALID[name][1]["sampling_params"].get("temperature") == 0.0:
                assert got.output_ids == ref.output_ids, name
            assert len(got.output_ids) == got.body["meta_info"]["completion_tokens"]
        else:
            assert got.body["choices"][0]["text"] == ref.body["choices"][0]["text"], name


def test_concurrent_requests_unaffected_and_server_healthy(servers, fault_run):
    _, graft, nospec = fault_run
    for i, (got, ref) in enumerate(zip(graft["background"], nospec["background"])):
        assert isinstance(got, Reply) and got.ok, (i, got)
        assert got.output_ids == ref.output_ids, i
    assert healthy(servers.graft.url) and healthy(servers.nospec.url)
    wait_idle(servers.graft.url, servers.baseline, timeout_s=60)


def test_prompt_over_the_speculative_context_budget(servers):
    """Graft, like EAGLE, reserves N context slots for the draft tree: a prompt that fits without
    speculation but not with it gets a 400 naming the context length; one token less is served."""
    limit = CONTEXT_LENGTH - RESERVED  # input tokens + RESERVED must stay below CONTEXT_LENGTH

    async def go(url, n):
        async with new_client(4) as client:
            return await generate(client, url, payload([266] * n, {"max_new_tokens": 4, "temperature": 0.0}))

    over = asyncio.run(go(servers.graft.url, limit))
    assert over.status == 400 and "context length" in str(over.body), over
    assert asyncio.run(go(servers.nospec.url, limit)).ok
    fits = asyncio.run(go(servers.graft.url, limit - 4))
    assert fits.ok and fits.output_ids == asyncio.run(go(servers.nospec.url, limit - 4)).output_ids


# --------------------------------------------------------------------- invalid plugin configuration
def _bad_config_file(tmp_path: Path) -> Path:
    p = tmp_path / "graft_bad.yaml"
    p.write_text("num_draft_tokens: 24\ntopk: 4\ndepth: 4\nretrieval:\n  sufix_max_depth: 12\n")
    return p


def _invalid_launches(draft: Path, tmp_path: Path) -> Dict[str, Any]:
    """name -> (extra args, extra env, words the output must contain)."""
    with_draft = ["--speculative-draft-model-path", str(draft)]
    return {
        "unknown_field_in_file": ([*with_draft, "--graft-config", str(_bad_config_file(tmp_path))], {},
                                  ["retrieval.sufix_max_depth", "extra"]),
        "unknown_flag": ([*with_draft, "--graft-bogus-knob", "1"], {}, ["--graft-bogus-knob"]),
        "budget_below_2": ([*with_draft, "--graft-budget", "1"], {}, ["num_draft_tokens", "--graft-budget"]),
        "topk_1": ([*with_draft, "--speculative-eagle-topk", "1"], {},
                   ["GraftSettingsError", "topk = 1", "--speculative-eagle-topk"]),
        "threshold_above_1": ([*with_draft, "--graft-checkpoints", "[{depth: 1, threshold: 1.5, keep: 6}]"],
                              {}, ["GraftSettingsError", "checkpoints.0.threshold = 1.5"]),
        "missing_draft_model": ([], {}, ["--speculative-draft-model-path"]),
        # combinations SGLang's EAGLE validation refuses but a custom algorithm skips (issue 14)
        "accept_threshold_single": ([*with_draft, "--speculative-accept-threshold-single", "0.5"], {},
                                    ["--speculative-accept-threshold-single"]),
        "accept_threshold_acc": ([*with_draft, "--speculative-accept-threshold-acc", "0.5"], {},
                                 ["--speculative-accept-threshold-acc"]),
        # (--attention-backend trtllm_mha is refused by SGLang itself off Hopper/Blackwell before the
        # plugin runs, so its graft refusal is a unit test: test_sglang_graft_units.py)
        "paged_tree_backend": ([*with_draft, "--page-size", "16"], {}, ["--page-size 16"]),
        "dp_attention": ([*with_draft, "--enable-dp-attention", "--tp-size", "2", "--dp-size", "2"], {},
                         ["--enable-dp-attention"]),
        # a config file's syntax error names the file and its line; a corpus entry outside the
        # vocabulary names the file and the entry (both before the model loads)
        "yaml_syntax_error": ([*with_draft, "--graft-config", str(_yaml_syntax_error_file(tmp_path))], {},
                              ["broken.yaml, line", "YAML syntax error"]),
        "corpus_out_of_vocab": ([*with_draft, "--graft-retrieval-corpus", "true", "--graft-retrieval-corpus-path",
                                 str(_corpus_file(tmp_path, [[5, 6, 7], [8, VOCAB + 3]]))], {},
                                ["retrieval.corpus_path", "corpus.jsonl, line 2", f"token id {VOCAB + 3}"]),
        "corpus_missing": ([*with_draft, "--graft-retrieval-corpus", "true", "--graft-retrieval-corpus-path",
                            str(tmp_path / "nowhere.jsonl")], {}, ["retrieval.corpus_path", "no such file"]),
        "lora": ([*with_draft, "--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj"], {},
                 ["--enable-lora"]),
    }


def _yaml_syntax_error_file(tmp_path: Path) -> Path:
    p = tmp_path / "broken.yaml"
    p.write_text("num_draft_tokens: 24\nretrieval:\n  suffix: [true\n  lookup: false\n")
    return p


def _corpus_file(tmp_path: Path, entries) -> Path:
    import json

    p = tmp_path / "corpus.jsonl"
    p.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return p


#: Each launch must fail within this many seconds (four processes at a time on 2 cores).
LAUNCH_LIMIT_S = 240


def _launch(model: Path, args: List[str], env: Dict[str, str]) -> Dict[str, Any]:
    import os

    from sglang_patch.launcher import CPU_SERVER_ARGS, free_port

    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
           "--port", str(free_port()), *CPU_SERVER_ARGS, "--speculative-algorithm", "graft", *args]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_LIMIT_S,
                           env={**os.environ, **env}, start_new_session=True)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = None, f"TIMEOUT after {LAUNCH_LIMIT_S} s: {exc.stdout!r}"
    return {"rc": rc, "out": out, "s": time.monotonic() - t0}


def _refusals(model: Path, cases: Dict[str, Any], tmp_path: Path) -> Dict[str, Dict[str, Any]]:
    """Every case's start-up in one process (tests/serving/refusals.py: SGLang's parsing and
    resolution, where ``launch_server`` refuses them): ``{name: {"rc", "out", "s"}}``."""
    import json
    import os

    from sglang_patch.launcher import CPU_SERVER_ARGS

    spec = {name: {"argv": ["--model-path", str(model), "--host", "127.0.0.1", "--port", "1", *CPU_SERVER_ARGS,
                            "--speculative-algorithm", "graft", *args], "env": env}
            for name, (args, env, _) in cases.items()}
    path = tmp_path / "refusals.json"
    path.write_text(json.dumps(spec))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(Path(__file__).with_name("refusals.py")), str(path)],
                       capture_output=True, text=True, timeout=LAUNCH_LIMIT_S, env=dict(os.environ))
    assert p.returncode == 0, p.stderr[-2000:]
    results = json.loads(p.stdout.strip().splitlines()[-1])
    s = (time.monotonic() - t0) / max(1, len(results))
    return {k: {**v, "s": s} for k, v in results.items()}


#: the cases launched as a real server process (the others start up in one process, `_refusals`)
LAUNCHED = ("unknown_field_in_file", "unknown_flag", "dp_attention")   # dp attention: refused after resolution


def test_invalid_plugin_configuration_refuses_to_start(quick_models, tmp_path, record_property):
    """Every invalid setting stops start-up with a message naming it, before any model loads. Three
    cases run ``python -m sglang.launch_server`` itself (non-zero exit); the others run the same
    start-up (SGLang's argument parsing and resolution, where the launcher refuses them) in one
    process, which imports SGLang once instead of once per case."""
    cases = _invalid_launches(quick_models.draft, tmp_path)
    with ThreadPoolExecutor(len(LAUNCHED) + 1) as pool:
        launched = {name: pool.submit(_launch, quick_models.target, cases[name][0], cases[name][1])
                    for name in LAUNCHED}
        rest = pool.submit(_refusals, quick_models.target,
                           {k: v for k, v in cases.items() if k not in LAUNCHED}, tmp_path)
        results = {**{name: f.result() for name, f in launched.items()}, **rest.result()}
    problems = []
    for name, (_, _, words) in cases.items():
        r = results[name]
        if r["rc"] in (0, None):
            problems.append((name, f"rc={r['rc']}", r["out"][-800:]))
            continue
        missing = [w for w in words if w.lower() not in r["out"].lower()]
        if missing:
            problems.append((name, f"output lacks {missing}", r["out"][-800:]))
        if "Load weight begin" in r["out"]:
            problems.append((name, "failed only after model loading started"))
    record_property("invalid_config_exit_s", {k: round(v["s"], 1) for k, v in results.items()})
    print("\nSERVING-INVALID-CONFIG", {k: (v["rc"], round(v["s"], 1)) for k, v in results.items()})
    assert not problems, problems
