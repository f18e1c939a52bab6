#!/usr/bin/env python
"""The quickstart's client: show Graft's text, check it against no speculation, report the speed-up.

    python scripts/quickstart_client.py --url http://127.0.0.1:PORT --reference-url http://127.0.0.1:PORT2 \
        --prompts data/humaneval_dev.jsonl --n 8

``--url`` serves Graft, ``--reference-url`` the same target without speculation (both float32).
1. Sampled completions (temperature 0.8, top-p 0.95, seeded) from the Graft server, printed as text
   (greedy text of a small model loops; sampled text shows what the model writes).
2. The same prompts greedily on both servers, at concurrency 1 and at 4 (``--concurrency``): the
   output token ids must be identical (exit 1 otherwise), then per concurrency the tokens/s ratio
   Graft / no-spec, how many of the Graft server's decode rounds speculated, the tau of those rounds,
   and one sentence on why.

The batch budget gives each decode round a verify width: 1 (a plain decode step) where speculating
would cost more than it earns, or more; a plain round is SGLang's own decode step. Counted per request:
rounds = ``meta_info.spec_verify_ct``; plain rounds = the Graft server's
``worker.batch_budget.tokens_by_width["1"]`` on ``GET /server_info``, read before and after the
greedy pass (a plain round emits exactly one token per request); speculated rounds = rounds - plain
rounds, and their tau = the tokens they emitted (bonus included) / their number. The report also
carries tau over every round (completion tokens / ``spec_verify_ct``), which plain rounds pull toward
1, and the grafted share of accepted tree tokens (``meta_info.graft_src``: one letter per accepted
node's source, `graft_spec.sources.SOURCE_LETTERS`; grafted = a retrieval source's node with no
draft member, `GRAFTED_SOURCES`).
Exits non-zero when a server fails, greedy outputs differ, or no verify round was reported.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from graft_spec.pipeline import GRAFTED_SOURCES, SOURCE_LETTERS  # noqa: E402
from sglang_patch.bench.prompts import load_prompts  # noqa: E402  (no engine import)


def generate_all(url: str, prompts: list[str], concurrency: int, **sampling) -> tuple[list[dict], float]:
    """``/generate`` for every prompt (``concurrency`` in flight); results in order and wall seconds."""
    def one(i_prompt):
        i, prompt = i_prompt
        params = {"max_new_tokens": sampling.get("max_new_tokens", 96), "temperature": 0.0, **sampling}
        if params["temperature"] > 0:
            params.setdefault("sampling_seed", 1000 + i)
        r = httpx.post(f"{url}/generate", json={"text": prompt, "sampling_params": params}, timeout=900)
        r.raise_for_status()
        return r.json()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(one, enumerate(prompts)))
    return outs, time.perf_counter() - t0


def plain_rounds(url: str) -> int | None:
    """Request-rounds the Graft server has run as plain decode steps so far (``GET /server_info``:
    ``worker.batch_budget.tokens_by_width["1"]``, summed over its schedulers; a plain round emits
    exactly one token per request, so its tokens count its request-rounds). 0 with the batch budget
    off; None when the server does not report it."""
    try:
        states = httpx.get(f"{url}/server_info", timeout=60).json().get("internal_states") or []
    except (httpx.HTTPError, ValueError):
        return None
    workers = [s.get("graft", {}).get("worker") for s in states if isinstance(s, dict)]
    workers = [w for w in workers if w]
    if not workers:
        return None
    return sum(int(((w.get("batch_budget") or {}).get("tokens_by_width") or {}).get("1", 0)) for w in workers)


def speculated(outs: list[dict], plain_before: int | None, plain_after: int | None) -> dict | None:
    """Decode rounds of ``outs`` (per request, ``meta_info.spec_verify_ct``), how many of them
    speculated (verify width > 1), and the tokens those rounds emitted per round, bonus included:
    (completion tokens - each request's prefill token - one per plain round) / speculated rounds.
    None without the plain-round counter."""
    if plain_before is None or plain_after is None:
        return None
    rounds = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    decoded = sum(o["meta_info"]["completion_tokens"] - 1 for o in outs if o["meta_info"]["completion_tokens"])
    plain = plain_after - plain_before
    spec = rounds - plain
    return {"rounds": rounds, "speculated_rounds": spec,
            "speculated_tau": round((decoded - plain) / spec, 3) if spec > 0 else None}


def measure(url: str, ref_url: str, prompts: list[str], concurrency: int, max_new: int) -> dict:
    """One greedy pass of ``prompts`` on both servers at ``concurrency``: equality, tokens/s of each,
    the speculated rounds and their tau (`speculated`), the grafted share."""
    ref, ref_s = generate_all(ref_url, prompts, concurrency, max_new_tokens=max_new)
    plain_before = plain_rounds(url)
    graft, graft_s = generate_all(url, prompts, concurrency, max_new_tokens=max_new)
    spec = speculated(graft, plain_before, plain_rounds(url))
    differ = [i for i, (a, b) in enumerate(zip(graft, ref)) if a["output_ids"] != b["output_ids"]]
    tokens = sum(o["meta_info"]["completion_tokens"] for o in graft)
    rounds = sum(o["meta_info"].get("spec_verify_ct", 0) for o in graft)
    src = Counter(ch for o in graft for ch in o["meta_info"].get("graft_src", []))
    accepted = sum(src[c] for c in SOURCE_LETTERS)
    grafted = sum(src[SOURCE_LETTERS[s]] for s in GRAFTED_SOURCES)
    ref_tokens = sum(o["meta_info"]["completion_tokens"] for o in ref)
    return {
        "concurrency": concurrency,
        "greedy_equal_to_no_spec": not differ, "differ": differ,
        "tau_all_rounds": round(tokens / rounds, 3) if rounds else None,
        **(spec or {}),
        "grafted_share": round(grafted / accepted, 3) if accepted else 0.0,
        "graft_tokens_per_s": round(tokens / graft_s, 1),
        "no_spec_tokens_per_s": round(ref_tokens / ref_s, 1),
        "tokens_per_s_ratio": round((tokens / graft_s) / (ref_tokens / ref_s), 3),
    }


def why(r: dict) -> str:
    """One plain sentence on a pass's figures."""
    c, ratio = r["concurrency"], r["tokens_per_s_ratio"]
    total, spec = r.get("rounds"), r.get("speculated_rounds")
    if total is None or spec is None:
        return f"concurrency {c}: tokens/s x{ratio} vs no speculation (the server reports no round counters)"
    if spec == 0:
        return (f"concurrency {c}: 0 of {total} decode rounds speculated, tokens/s x{ratio} vs no speculation: "
                f"the batch budget measured that a verify round costs more here than the tokens it adds, so "
                f"every round was SGLang's own decode step")
    share = spec / total if total else 0.0
    return (f"concurrency {c}: {spec} of {total} decode rounds speculated ({share:.0%}), tau {r['speculated_tau']} "
            f"in those (grafted share {r['grafted_share']:.0%}), tokens/s x{ratio} vs no speculation: "
            + ("speculating paid, the budget kept it" if ratio >= 1.0 else
               "the budget speculated where its measured round times said it would pay; the other rounds "
               "were SGLang's decode step"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="Graft server")
    ap.add_argument("--reference-url", required=True, help="the same target without speculation")
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--n", type=int, default=8, help="number of prompts")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args()
    prompts = [p.text for p in load_prompts(args.prompts, args.n)]

    sampled, _ = generate_all(args.url, prompts, max(args.concurrency), max_new_tokens=args.max_new_tokens,
                              temperature=0.8, top_p=0.95)
    for i, (prompt, out) in enumerate(zip(prompts, sampled)):
        print(f"=== prompt {i} (sampled, T 0.8 / top-p 0.95) ===")
        print(prompt.rstrip()[-200:])
        print("--- completion ---")
        print(out["text"].rstrip() or "(empty)")
        print()

    # warm both servers' code paths once, then time greedy passes
    generate_all(args.reference_url, prompts[:1], 1, max_new_tokens=8)
    generate_all(args.url, prompts[:1], 1, max_new_tokens=8)
    reports = [measure(args.url, args.reference_url, prompts, c, args.max_new_tokens) for c in args.concurrency]
    sampled_tau = round(sum(o["meta_info"]["completion_tokens"] for o in sampled)
                        / max(1, sum(o["meta_info"].get("spec_verify_ct", 0) for o in sampled)), 3)
    for r in reports:
        print("quickstart:", json.dumps({**{k: v for k, v in r.items() if k != "differ"}, "sampled_tau": sampled_tau}))
    bad = [r for r in reports if r["differ"]]
    for r in bad:
        print(f"quickstart: greedy outputs of prompts {r['differ']} differ from no speculation at concurrency "
              f"{r['concurrency']}", file=sys.stderr)
    if bad:
        return 1
    if not any(r.get("rounds") or r["tau_all_rounds"] for r in reports):
        print("quickstart: the Graft server reported no verify rounds", file=sys.stderr)
        return 1
    print(f"quickstart: greedy Graft output identical to no speculation on {len(prompts)} prompts "
          f"(concurrency {', '.join(str(c) for c in args.concurrency)})")
    for r in reports:
        print("quickstart: " + why(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
