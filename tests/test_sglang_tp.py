"""Tensor parallelism on CPU (``--tp-size 2``, gloo), fp32, quick models: every speculative method
against the single-rank target without speculation.

What must hold (issue 14):
* graft, EAGLE3 and NGRAM at TP 2 give, greedily, token for token the single-rank no-speculation
  outputs for the HumanEval prompts, the first 8 at concurrency 1 and all 24 at concurrency 8 (so
  the CPU TP layer itself, gloo all-reduce of row- and column-parallel layers, is exact in fp32);
* graft does so with one rank's retrieval state deliberately perturbed
  (``GRAFT_FAULT_PERTURB_RANK=1``: rank 1 reverses its host proposals and its draft scores before
  every tree build): both ranks verify rank 0's tree and nothing hangs (the test's timeout bounds
  it; without the tree broadcast the vocab-parallel embedding mixes two trees and the ranks
  deadlock);
* tenant isolation on a real server: tenant A's repeated text raises tenant B's acceptance with
  ``retrieval.isolation: shared`` and not with ``tenant`` (the tenant is the request's ``extra_key``).

Each TP rank runs one OpenMP thread on its own core (``SGLANG_CPU_OMP_THREADS_BIND="0|1"``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from sglang_patch.bench.prompts import completion_text

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_server import REQUEST_TIMEOUT_S, accept_length, generate_many, serve, serve_all  # noqa: E402
from test_sglang_graft_server import CODE, COMMON, GRAFT, MAX_NEW, QUICK, SHAPE  # noqa: E402

pytestmark = [
    pytest.mark.server,
    pytest.mark.models,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(not (QUICK / "DONE").exists(), reason="quick models missing: scripts/make_models.py --quick"),
]

TP2 = ["--tp-size", "2"]
TP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "OMP_NUM_THREADS": "1"}
EAGLE3 = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(QUICK / "draft"), *SHAPE]
NGRAM = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "24"]


#: prompts sent one at a time (the rest of the 24 only at concurrency 8)
SERIAL_PROMPTS = 8


@pytest.fixture(scope="module")
def reference(code_reference) -> list[list[int]]:
    """Single-rank greedy output ids without speculation (concurrency 1; tests/conftest.py)."""
    return code_reference


def _tp_run(args: list[str], name: str, env: dict | None = None) -> tuple[dict[int, list[dict]], str]:
    """Outputs of a TP-2 server: the first `SERIAL_PROMPTS` at concurrency 1, all at 8; and its log."""
    with serve(QUICK / "target", [*COMMON, *TP2, *args], name=name, env={**TP_ENV, **(env or {})}) as srv:
        runs = {1: generate_many(srv.url, CODE[:SERIAL_PROMPTS], concurrency=1, max_new_tokens=MAX_NEW),
                8: generate_many(srv.url, CODE, concurrency=8, max_new_tokens=MAX_NEW)}
        return runs, srv.log_tail(200_000)


def _check_equal(runs: dict[int, list[dict]], reference: list[list[int]]) -> None:
    for c, outs in runs.items():
        bad = [i for i, (o, r) in enumerate(zip(outs, reference)) if o["output_ids"] != r]
        assert not bad, f"concurrency {c}: prompts {bad} differ from the single-rank no-spec output"
        print(f"\nTP2 concurrency {c}: accept length {accept_length(outs):.3f}")


@pytest.mark.timeout(900)
def test_tp2_graft_with_one_rank_perturbed_still_verifies_rank0s_tree(reference):
    # every round speculates: the batch budget may step aside at concurrency 8 on two CPU ranks, and
    # a plain round verifies no tree, so the accept length would say nothing about rank 0's trees
    runs, log = _tp_run(GRAFT, "tp_graft_perturbed", env={"GRAFT_FAULT_PERTURB_RANK": "1",
                                                          "GRAFTCFG_BATCH_BUDGET__ENABLED": "false"})
    _check_equal(runs, reference)
    assert "GRAFT_FAULT_PERTURB_RANK" in log, "the fault was not injected (no notice in the server log)"
    assert min(accept_length(outs) for outs in runs.values()) > 1.5


def test_tp2_eagle3_equals_single_rank_no_spec(reference):
    _check_equal(_tp_run(EAGLE3, "tp_eagle3")[0], reference)


def test_tp2_ngram_equals_single_rank_no_spec(reference):
    _check_equal(_tp_run(NGRAM, "tp_ngram")[0], reference)


# ----------------------------------------------------------------------------- tenant isolation

#: The shipped pair (models/default, in git): the quick target's greedy text is so repetitive that its
#: own prompt already predicts all of it, so another tenant's text could not change anything there.
SHIPPED = QUICK.parent / "default"
ISOLATION_PROMPTS = 4


def _isolation_prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(SHIPPED / "target"))
    rows = [json.loads(x) for x in (QUICK.parents[1] / "data" / "humaneval_dev.jsonl").read_text().splitlines()]
    # completion_text: a prompt ending in a bare newline makes the shipped target end the file at once
    return [tok.encode(completion_text(r["prompt"]), add_special_tokens=False)[-192:]
            for r in rows[:ISOLATION_PROMPTS]]


def _isolation_server(isolation: str) -> tuple:
    """A shipped-pair graft server's spec for `serve_all` under ``isolation`` (draft nodes, suffix
    index and lookup off, so only the successor table proposes, and only it can carry A's text to B)."""
    env = {"GRAFTCFG_RETRIEVAL__ISOLATION": isolation, "GRAFTCFG_RETRIEVAL__SUFFIX": "false",
           "GRAFTCFG_RETRIEVAL__LOOKUP": "false",
           # every round speculates (the batch budget could pick plain rounds, which have no verify count)
           "GRAFTCFG_BATCH_BUDGET__ENABLED": "false",
           # retrieval only: the shipped draft predicts this text well enough to hide the table's effect
           "GRAFTCFG_DRAFT_NODES": "false"}
    graft = ["--speculative-algorithm", "graft", "--speculative-draft-model-path", str(SHIPPED / "draft"), *SHAPE]
    return SHIPPED / "target", [*COMMON, *graft], f"isolation_{isolation}", env


def _tenant_rounds(url: str, prompts: list[list[int]]) -> tuple[int, int]:
    """(tenant A's, tenant B's) verify rounds over ``prompts``: for each prompt A generates twice,
    then B once with the same prompt."""
    rounds = {"a": 0, "b": 0}
    for ids in prompts:
        for tenant in ("a", "a", "b"):
            body = {"input_ids": ids, "extra_key": tenant,
                    "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0}}
            r = httpx.post(f"{url}/generate", json=body, timeout=REQUEST_TIMEOUT_S)
            r.raise_for_status()
            meta = r.json()["meta_info"]
            assert meta["completion_tokens"] > 1, f"tenant {tenant}: the request ended at prefill"
            rounds[tenant] += meta["spec_verify_ct"]
    return rounds["a"], rounds["b"]


@pytest.mark.skipif(not (SHIPPED / "MANIFEST.json").exists(), reason="the shipped pair models/default is missing "
                    "(the planner-level isolation test, tests/test_core_step.py, runs without it)")
def test_tenant_isolation_keeps_tenant_as_text_from_tenant_bs_tree():
    prompts = _isolation_prompts()
    with serve_all([_isolation_server("shared"), _isolation_server("tenant")]) as (shared_srv, tenant_srv):
        shared, tenant = _tenant_rounds(shared_srv.url, prompts), _tenant_rounds(tenant_srv.url, prompts)
    print(f"\nISOLATION verify rounds (tenant A twice, tenant B once per prompt): shared {shared}, tenant {tenant}")
    assert shared[1] < tenant[1], "with a shared successor table tenant A's text should shorten tenant B's decode"
