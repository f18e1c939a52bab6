"""Stock EAGLE-3 speculative decoding in the real SGLang 0.5.23 server on CPU (sglang_patch/cpu).

Four server processes on loopback, one at a time (module-scoped fixtures, ~1 min start each):

* ``reference`` - the quick target without speculation: greedy output ids of every prompt;
* ``tree``  - EAGLE-3 with a top-k 4 tree (4 steps, 16 verify tokens), SGLang's default
  (synchronous) scheduler on CPU;
* ``chain`` - EAGLE-3 with top-k 1 (3 steps, 4 verify tokens), with the overlap scheduler kept on
  (``GRAFT_SGLANG_CPU_OVERLAP=1``, see sglang_patch/cpu/overlap.py);
* ``ngram`` - SGLang's NGRAM (retrieval-only) speculation with its default tree.

What must hold: greedy output token ids equal the reference for every prompt at concurrency 1 and
8 on both trees; the server-reported mean accept length is > 1; the OpenAI endpoints answer
(streaming and not, same text); sampled requests run through the sampling verify path.
Prompts: data/humaneval_dev.jsonl and data/mtbench_dev.jsonl (provenance in data/README.md).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_server import accept_length, generate_many, serve, stream_text  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUICK = ROOT / "models" / "quick"
pytestmark = [
    pytest.mark.server,
    pytest.mark.models,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(not (QUICK / "DONE").exists(), reason="quick models missing: scripts/make_models.py --quick"),
]

MAX_NEW = 32
PROMPT_TOKENS = 192          # keep the last tokens of long prompts (bounded CPU time)
# --mem-fraction-static 0.5: SGLang sizes the KV budget from *free host RAM* measured before and
# after loading weights; with other processes allocating meanwhile, the launcher's 0.1 can fail
# ("Loaded weights leave no GPU memory"). --max-total-tokens caps the pool actually allocated.
COMMON = ["--dtype", "float32", "--random-seed", "0", "--max-running-requests", "16",
          "--max-total-tokens", "32768", "--mem-fraction-static", "0.5"]
EAGLE = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(QUICK / "draft")]
TREE = ["--speculative-num-steps", "4", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16"]
CHAIN = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]


def _prompt_ids() -> list[list[int]]:
    """12 HumanEval prompts + 8 MT-Bench first turns, tokenised with the quick tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(QUICK / "target"))
    code = [json.loads(x)["prompt"] for x in (ROOT / "data" / "humaneval_dev.jsonl").read_text().splitlines()[:12]]
    chat = [json.loads(x)["turns"][0] for x in (ROOT / "data" / "mtbench_dev.jsonl").read_text().splitlines()[:8]]
    return [tok.encode(p, add_special_tokens=False)[-PROMPT_TOKENS:] for p in code + chat]


PROMPTS = _prompt_ids() if (QUICK / "DONE").exists() else []


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Greedy output ids without speculation, concurrency 1."""
    assert len(PROMPTS) == 20, "prompt ids are read at import time: models must exist (conftest builds them)"
    with serve(QUICK / "target", COMMON, name="cpu_nospec") as srv:
        outs = generate_many(srv.url, PROMPTS, concurrency=1, max_new_tokens=MAX_NEW)
    assert all("spec_verify_ct" not in o["meta_info"] or not o["meta_info"]["spec_verify_ct"] for o in outs)
    return [o["output_ids"] for o in outs]


@pytest.fixture(scope="class")
def tree(reference):
    """The top-k 4 tree server (class scope: stopped before the chain server starts)."""
    with serve(QUICK / "target", COMMON + EAGLE + TREE, name="cpu_eagle_tree") as srv:
        yield srv


def _check_lossless(url: str, reference: list[list[int]], concurrency: int, label: str) -> float:
    outs = generate_many(url, PROMPTS, concurrency=concurrency, max_new_tokens=MAX_NEW)
    bad = [i for i, (o, r) in enumerate(zip(outs, reference)) if o["output_ids"] != r]
    assert not bad, f"{label}: prompts {bad} differ, e.g. {outs[bad[0]]['output_ids']} vs {reference[bad[0]]}"
    acc = accept_length(outs)
    print(f"\n{label}: {len(outs)} prompts identical to no-speculation, mean accept length {acc:.3f}")
    return acc


class TestTree:
    """EAGLE-3 top-k 4 tree, SGLang's default synchronous spec v2 scheduler on CPU."""

    @pytest.mark.parametrize("concurrency", [1, 8])
    def test_greedy_equals_no_speculation(self, tree, reference, concurrency, record_property):
        acc = _check_lossless(tree.url, reference, concurrency, f"EAGLE3 topk=4 tree, concurrency {concurrency}")
        record_property("accept_length", acc)
        assert acc > 1.0
        assert "Non-overlap (synchronous) spec v2" in tree.log_tail(10**7)

    def test_openai_endpoints(self, tree):
        base = {"model": "default", "max_tokens": 16, "temperature": 0}
        comp = httpx.post(f"{tree.url}/v1/completions", json={**base, "prompt": "def fib(n):\n"}, timeout=600)
        comp.raise_for_status()
        text = comp.json()["choices"][0]["text"]
        assert comp.json()["usage"]["completion_tokens"] == 16
        streamed = stream_text(f"{tree.url}/v1/completions", {**base, "prompt": "def fib(n):\n", "stream": True},
                               chat=False)
        assert streamed == text

        msgs = [{"role": "user", "content": "Write a function that reverses a list."}]
        chat = httpx.post(f"{tree.url}/v1/chat/completions", json={**base, "messages": msgs}, timeout=600)
        chat.raise_for_status()
        answer = chat.json()["choices"][0]["message"]["content"]
        assert chat.json()["usage"]["completion_tokens"] == 16
        streamed = stream_text(f"{tree.url}/v1/chat/completions", {**base, "messages": msgs, "stream": True},
                               chat=True)
        assert streamed == answer

    def test_sampled_requests_use_sampling_verify(self, tree):
        """T=0.8 / top-p 0.95 / top-k 40 requests (some seeded) run through target-only tree sampling."""
        outs = generate_many(tree.url, PROMPTS[:8], concurrency=4, max_new_tokens=MAX_NEW, temperature=0.8,
                             top_p=0.95, top_k=40)
        seeded = generate_many(tree.url, PROMPTS[8:10], concurrency=2, max_new_tokens=MAX_NEW, temperature=0.8,
                               sampling_seed=1234)
        for o in outs + seeded:
            assert 0 < o["meta_info"]["completion_tokens"] <= MAX_NEW
        acc = accept_length(outs + seeded)
        print(f"\nEAGLE3 topk=4 tree, sampled (T=0.8): mean accept length {acc:.3f}")
        assert acc > 1.0


def test_chain_with_overlap_greedy_equals_no_speculation(reference, record_property):
    """top-k 1 chain, overlap scheduler on: lossless at concurrency 1 and 8."""
    with serve(QUICK / "target", COMMON + EAGLE + CHAIN, name="cpu_eagle_chain",
               env={"GRAFT_SGLANG_CPU_OVERLAP": "1"}) as srv:
        accs = [_check_lossless(srv.url, reference, c, f"EAGLE3 topk=1 chain + overlap, concurrency {c}")
                for c in (1, 8)]
        log = srv.log_tail(10**7)
    assert "Non-overlap (synchronous) spec v2" not in log and "'disable_overlap_schedule': False" in log
    record_property("accept_length", accs[0])
    assert min(accs) > 1.0


def test_ngram_greedy_equals_no_speculation(reference, record_property):
    """NGRAM (C++ corpus built with g++, torch tree metadata): lossless at concurrency 1 and 8."""
    with serve(QUICK / "target", COMMON + ["--speculative-algorithm", "NGRAM"], name="cpu_ngram") as srv:
        accs = [_check_lossless(srv.url, reference, c, f"NGRAM, concurrency {c}") for c in (1, 8)]
    record_property("accept_length", accs[0])
    assert min(accs) > 1.0
