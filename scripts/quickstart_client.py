#!/usr/bin/env python
"""The quickstart's client: show Graft's text, check it against no speculation, report the speed-up.

    python scripts/quickstart_client.py --url http://127.0.0.1:PORT --reference-url http://127.0.0.1:PORT2 \
        --prompts data/humaneval_dev.jsonl --n 8

``--url`` serves Graft, ``--reference-url`` the same target without speculation (both float32).
1. Sampled completions (temperature 0.8, top-p 0.95, seeded) from the Graft server, printed as text
   (greedy text of a small model loops; sampled text shows what the model writes).
2. The same prompts greedily on both servers, concurrency 4: the output token ids must be identical
   (exit 1 otherwise), then tau (accepted tokens per verify step, bonus included: completion tokens /
   ``spec_verify_ct``), the grafted share of accepted tokens (``meta_info.graft_src``: ``d`` draft,
   ``r`` grafted, ``p`` padding) and the tokens/s ratio Graft / no-spec on that run.
Exits non-zero when a server fails, greedy outputs differ, or no speculative round was reported.
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="Graft server")
    ap.add_argument("--reference-url", required=True, help="the same target without speculation")
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--n", type=int, default=8, help="number of prompts")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    prompts = [p.text for p in load_prompts(args.prompts, args.n)]

    sampled, _ = generate_all(args.url, prompts, args.concurrency, max_new_tokens=args.max_new_tokens,
                              temperature=0.8, top_p=0.95)
    for i, (prompt, out) in enumerate(zip(prompts, sampled)):
        print(f"=== prompt {i} (sampled, T 0.8 / top-p 0.95) ===")
        print(prompt.rstrip()[-200:])
        print("--- completion ---")
        print(out["text"].rstrip() or "(empty)")
        print()

    # warm both servers' code paths once, then time the greedy pass
    generate_all(args.reference_url, prompts[:1], 1, max_new_tokens=8)
    ref, ref_s = generate_all(args.reference_url, prompts, args.concurrency, max_new_tokens=args.max_new_tokens)
    graft, graft_s = generate_all(args.url, prompts, args.concurrency, max_new_tokens=args.max_new_tokens)
    differ = [i for i, (a, b) in enumerate(zip(graft, ref)) if a["output_ids"] != b["output_ids"]]
    tokens = sum(o["meta_info"]["completion_tokens"] for o in graft)
    rounds = sum(o["meta_info"].get("spec_verify_ct", 0) for o in graft)
    src = Counter(ch for o in graft for ch in o["meta_info"].get("graft_src", []))
    accepted = src["d"] + src["r"] + src["p"]
    ref_tokens = sum(o["meta_info"]["completion_tokens"] for o in ref)
    report = {
        "greedy_equal_to_no_spec": not differ,
        "tau": round(tokens / rounds, 3) if rounds else None,
        "grafted_share": round(src["r"] / accepted, 3) if accepted else 0.0,
        "graft_tokens_per_s": round(tokens / graft_s, 1),
        "no_spec_tokens_per_s": round(ref_tokens / ref_s, 1),
        "tokens_per_s_ratio": round((tokens / graft_s) / (ref_tokens / ref_s), 3),
        "sampled_tau": round(sum(o["meta_info"]["completion_tokens"] for o in sampled)
                             / max(1, sum(o["meta_info"].get("spec_verify_ct", 0) for o in sampled)), 3),
    }
    print("quickstart:", json.dumps(report))
    if differ:
        print(f"quickstart: greedy outputs of prompts {differ} differ from no speculation", file=sys.stderr)
        return 1
    if not rounds:
        print("quickstart: the Graft server reported no speculative verify rounds", file=sys.stderr)
        return 1
    print(f"quickstart: greedy Graft output identical to no speculation on {len(prompts)} prompts; "
          f"tau {report['tau']}, grafted share {report['grafted_share']:.0%}, "
          f"tokens/s x{report['tokens_per_s_ratio']} vs no speculation (greedy, concurrency {args.concurrency})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
